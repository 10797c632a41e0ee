"""bootstrap/setup-local-nvme.sh on real disks, in a QEMU guest.

Each boot runs the Debian kernel with a small initramfs (tests/guest/qemu.py) and emulated NVMe
disks whose serial says what they stand for: ``AWS...`` an instance-store disk, ``vol...`` an EBS
volume; the guest shows the NVMe models EC2 reports for them, so the script runs with its
defaults, exactly as on a node. Disk images are sparse files that persist across the boots of a
test, which is how reboots (same images) and EC2 stop/start (images zeroed) are played.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.guest import qemu, userdata

pytestmark = [pytest.mark.slow, pytest.mark.qemu]

SCRIPT = userdata.BOOTSTRAP / "setup-local-nvme.sh"
UNIT = userdata.BOOTSTRAP / "setup-local-nvme.service"
USER_DATA = userdata.BOOTSTRAP / "user-data.mime"
RUN = userdata.INSTALLED_SCRIPT
MOUNT = "/mnt/k8s-disks/local-nvme"
CACHE = f"{MOUNT}/huggingface"
EBS_SERIAL = "vol0a1b2c3d4e5f60718"

# Stands in for systemctl in the guest (there is no systemd): logs each call, and runs the unit's
# ExecStart= for "start UNIT" or "enable --now UNIT", as systemd does for a oneshot unit.
SYSTEMCTL_STUB = b"""#!/bin/bash
echo "systemctl $*" >> /run/systemctl.log
if [[ $1 == start || ($1 == enable && $2 == --now) ]]; then
    exec_start=$(sed -n 's/^ExecStart=//p' "/etc/systemd/system/${*: -1}")
    $exec_start
fi
"""

# Scenario prelude: `state` prints what the tests compare, as key=value lines.
PRELUDE = f"""
export MOUNT={MOUNT}
export CACHE={CACHE}
state() {{
    local md line
    for md in /sys/block/md*; do
        [ -e "$md/md/level" ] || continue
        echo "md=${{md##*/}} state=$(cat $md/md/array_state) level=$(cat $md/md/level)" \\
            "disks=$(cat $md/md/raid_disks) chunk=$(cat $md/md/chunk_size)" \\
            "members=$(cd $md/slaves && echo * | tr ' ' ,)"
    done
    line=$(grep -F " $MOUNT " /proc/self/mountinfo | tail -n 1)
    echo "mount=$line"
    if [ -n "$line" ]; then
        set -- ${{line#* - }}
        blkid -p -o export "$2" | sed 's/^/fs_/'
    fi
    echo "cache=$(stat -c '%u:%g %a' $CACHE 2>/dev/null)"
}}
"""


@pytest.fixture(scope="session")
def kit(tmp_path_factory: pytest.TempPathFactory) -> qemu.GuestKit:
    reason = qemu.missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    return qemu.build_initramfs(tmp_path_factory.mktemp("guest-kit"))


def instance_store(path: Path, index: int) -> qemu.Disk:
    return qemu.Disk(qemu.make_disk(path / f"instance-store-{index}.img"), f"AWS{index:017X}")


def ebs_volume(path: Path) -> qemu.Disk:
    """An EBS volume with data on it that nothing may change."""
    head = hashlib.shake_256(b"ebs volume").digest(1 << 20)
    return qemu.Disk(qemu.make_disk(path / "ebs.img", head=head), EBS_SERIAL)


def by_id(disk: qemu.Disk) -> str:
    return f"/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_{disk.serial}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as image:
        while chunk := image.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def boot(
    kit: qemu.GuestKit,
    tmp_path: Path,
    name: str,
    disks: Sequence[qemu.Disk],
    scenario: str,
    *,
    udev: bool = True,
    installed: bool = True,
) -> qemu.GuestRun:
    """Boot, run the scenario and power off. ``installed``: the script is already on the node
    (as the user data of an earlier boot left it); otherwise only the user data is there."""
    if udev and not kit.has_udev:
        pytest.skip("udev (udevadm and its rules) is not installed on the host")
    files = {"/usr/local/bin/systemctl": SYSTEMCTL_STUB}
    if installed:
        files[RUN] = SCRIPT.read_bytes()
    else:
        files["/guest/user-data.sh"] = userdata.shell_part(USER_DATA.read_bytes())
    run = qemu.boot(
        kit,
        name=name,
        workdir=tmp_path,
        disks=disks,
        scenario=PRELUDE + scenario,
        files=files,
        udev=udev,
    )
    print(f"boot {name}: {run.seconds:.1f} s")
    run.check_finished()
    return run


def state(step: qemu.Step) -> dict:
    """Parse the prelude's `state` output."""
    result: dict = {"md": []}
    for line in step.output.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "md":
            result["md"].append(dict(token.split("=", 1) for token in line.split()))
        elif key == "mount" and value:
            fields = value.split()
            fstype, source = fields[fields.index("-") + 1 : fields.index("-") + 3]
            result["mount"] = {"source": source, "fstype": fstype, "options": fields[5]}
        elif key != "mount":
            result[key] = value
    return result


def log_of(step: qemu.Step) -> list[str]:
    return [line for line in step.output.splitlines() if line.startswith("setup-local-nvme: ")]


def ok(run: qemu.GuestRun, name: str) -> qemu.Step:
    """The step, which must have exited 0."""
    step = run[name]
    assert step.rc == 0, f"step {name} exited {step.rc}:\n{step.output}\n{run.tail()}"
    return step


def assert_logged(step: qemu.Step, *fragments: str) -> None:
    lines = "\n".join(log_of(step))
    for fragment in fragments:
        assert fragment in lines, f"{fragment!r} not logged:\n{step.output}"


def assert_not_logged(step: qemu.Step, *fragments: str) -> None:
    lines = "\n".join(log_of(step))
    for fragment in fragments:
        assert fragment not in lines, f"{fragment!r} logged:\n{step.output}"


def assert_raid0(found: dict, disks: Sequence[str]) -> None:
    (array,) = found["md"]
    assert array["level"] == "raid0"
    assert array["disks"] == str(len(disks))
    assert array["chunk"] == str(512 * 1024)
    assert sorted(array["members"].split(",")) == sorted(disks)
    assert found["mount"]["source"] == f"/dev/{array['md']}"
    assert found["mount"]["fstype"] == "xfs"
    assert "noatime" in found["mount"]["options"].split(",")
    assert found["fs_TYPE"] == "xfs"
    assert found["fs_LABEL"] == "local-nvme"
    assert found["cache"] == "65532:65532 755"


@pytest.mark.timeout(1200)
def test_four_disks_create_reboot_stale_link_and_stop_start(
    kit: qemu.GuestKit, tmp_path: Path
) -> None:
    aws = [instance_store(tmp_path, index) for index in range(1, 5)]
    ebs = ebs_volume(tmp_path)
    # The EBS volume sits between instance-store disks: /dev/nvmeN order means nothing.
    disks = [aws[0], aws[1], ebs, aws[2], aws[3]]
    members = ["nvme0n1", "nvme1n1", "nvme3n1", "nvme4n1"]
    ebs_before = sha256(ebs.image)

    # First boot: the user data installs the script and the unit, and starts it; then the
    # script runs again, as on the next boot, and changes nothing.
    first = boot(
        kit,
        tmp_path,
        "create",
        disks,
        f"""
        step by-id ls /dev/disk/by-id
        step user-data bash /guest/user-data.sh
        step systemctl cat /run/systemctl.log
        step installed sha256sum {RUN} {userdata.INSTALLED_UNIT}
        step state-1 state
        step again {RUN}
        step state-2 state
        step write sh -c 'echo kept > $CACHE/marker && sync'
        step umount umount $MOUNT
        """,
        installed=False,
    )
    assert by_id(aws[0]).rsplit("/", 1)[1] in ok(first, "by-id").output
    created = ok(first, "user-data")
    assert_logged(
        created,
        f"/dev/nvme2n1 (model 'Amazon Elastic Block Store', serial {EBS_SERIAL}): not instance "
        "store, leaving it alone",
        "creating RAID-0 array local-nvme (chunk 512 KiB) over 4 empty disks",
        "formatting /dev/md127 as XFS (label local-nvme)",
        "mounting /dev/md127 (UUID=",
        f"created {CACHE} (owner 65532:65532, mode 0755)",
        f"ready: {CACHE} on /dev/md127 (RAID-0 of 4 disks); changed: created array local-nvme, "
        "formatted /dev/md127, ",
    )
    assert "log stripe unit" not in created.output
    assert ok(first, "systemctl").output.splitlines() == [
        "systemctl daemon-reload",
        "systemctl enable --now setup-local-nvme.service",
    ]
    installed = ok(first, "installed").output.split()
    assert installed[0] == hashlib.sha256(SCRIPT.read_bytes()).hexdigest()
    assert installed[2] == hashlib.sha256(UNIT.read_bytes()).hexdigest()
    created_state = state(ok(first, "state-1"))
    assert_raid0(created_state, members)
    again = ok(first, "again")
    assert_logged(
        again,
        "array local-nvme is already running as /dev/md127",
        "/dev/md127 already has an XFS file system",
        f"/dev/md127 is already mounted at {MOUNT}",
        f"ready: {CACHE} on /dev/md127 (RAID-0 of 4 disks); everything was already in place",
    )
    assert_not_logged(again, "creating", "formatting", "mounting", "assembling")
    assert state(ok(first, "state-2")) == created_state
    ok(first, "write")
    ok(first, "umount")
    uuid = created_state["fs_UUID"]

    # Reboot with udev, as on a node: udev assembles the array from its disks; the script finds
    # it running (or assembles it) and mounts the same file system with the data on it.
    second = boot(
        kit,
        tmp_path,
        "reboot",
        disks,
        f"""
        step before cat /proc/mdstat
        step run {RUN}
        step state state
        step marker cat $CACHE/marker
        """,
    )
    rebooted = ok(second, "run")
    assert "md127 : active raid0" in ok(second, "before").output
    assert_logged(
        rebooted,
        "array local-nvme is already running as /dev/md127",
        f"mounting /dev/md127 (UUID={uuid})",
        "changed: ",
    )
    assert_not_logged(rebooted, "creating", "formatting")
    after_reboot = state(ok(second, "state"))
    assert_raid0(after_reboot, members)
    assert after_reboot["fs_UUID"] == uuid
    assert ok(second, "marker").output == "kept"

    # Reboot without udev: the script assembles the array itself. Then stop it: without udev
    # /dev/md/local-nvme survives `mdadm --stop`; that stale link must not pass for an array.
    # Then leave an array put together from one disk only (as udev does while disks appear):
    # the script stops it and assembles all four. Last, lose a disk's superblock: the script
    # must fail loudly, not build anything over the remaining disks.
    third = boot(
        kit,
        tmp_path,
        "reboot-no-udev",
        disks,
        f"""
        step run {RUN}
        step marker cat $CACHE/marker
        step stop sh -c 'umount $MOUNT && mdadm --stop /dev/md/local-nvme'
        step link readlink -f /dev/md/local-nvme
        step stale-detail mdadm --detail /dev/md/local-nvme
        step run-stale {RUN}
        step state state
        step marker-stale cat $CACHE/marker
        step partial sh -c 'umount $MOUNT && mdadm --stop /dev/md127 \
            && mdadm --incremental /dev/nvme0n1 && grep -c inactive /proc/mdstat'
        step run-partial {RUN}
        step marker-partial cat $CACHE/marker
        step lose-disk sh -c 'umount $MOUNT && mdadm --stop /dev/md127 \
            && mdadm --zero-superblock /dev/nvme4n1'
        step run-lost {RUN}
        step lost-blank blkid -p -o export /dev/nvme4n1
        step lost-mount grep -c ' /mnt/k8s-disks/local-nvme ' /proc/self/mountinfo
        """,
        udev=False,
    )
    assembled = ok(third, "run")
    assert_logged(
        assembled,
        "assembling array local-nvme from 4 disk(s)",
        f"mounting /dev/md127 (UUID={uuid})",
        "changed: assembled array local-nvme, ",
        "mounted /dev/md127",
    )
    assert ok(third, "marker").output == "kept"
    ok(third, "stop")
    assert ok(third, "link").output.strip() == "/dev/md127"
    assert third["stale-detail"].rc != 0
    after_stale = ok(third, "run-stale")
    assert_logged(
        after_stale,
        "/dev/md/local-nvme -> /dev/md127 is stale",
        "assembling array local-nvme from 4 disk(s)",
        f"mounting /dev/md127 (UUID={uuid})",
    )
    assert state(ok(third, "state"))["fs_UUID"] == uuid
    assert ok(third, "marker-stale").output == "kept"
    assert ok(third, "partial").output.splitlines()[-1] == "1"
    assert_logged(
        ok(third, "run-partial"),
        "(local-nvme) is assembled but not running: stopping it to assemble it again",
        "assembling array local-nvme from 4 disk(s)",
        f"mounting /dev/md127 (UUID={uuid})",
    )
    assert ok(third, "marker-partial").output == "kept"
    ok(third, "lose-disk")
    lost = third["run-lost"]
    assert lost.rc == 1, lost.output
    assert_logged(
        lost,
        "assembling array local-nvme from 3 disk(s): /dev/nvme0n1 /dev/nvme1n1 /dev/nvme3n1",
        "setup-local-nvme: error: could not assemble local-nvme",
    )
    assert_not_logged(lost, "creating", "formatting", "mounting", "unexpected failure")
    assert third["lost-blank"].rc == 2, "the script wrote to the disk that lost its superblock"
    assert third["lost-mount"].output == "0"

    # EC2 stop/start: the instance comes back with empty instance-store disks. The script
    # builds a new array and file system; the cache starts empty.
    for disk in aws:
        qemu.wipe_disk(disk.image)
    fourth = boot(
        kit,
        tmp_path,
        "stop-start",
        disks,
        f"""
        step run {RUN}
        step state state
        step marker test ! -e $CACHE/marker
        """,
    )
    rebuilt = ok(fourth, "run")
    assert_logged(
        rebuilt,
        "creating RAID-0 array local-nvme (chunk 512 KiB) over 4 empty disks",
        "formatting /dev/md127 as XFS",
    )
    after_wipe = state(ok(fourth, "state"))
    assert_raid0(after_wipe, members)
    assert after_wipe["fs_UUID"] != uuid
    ok(fourth, "marker")

    assert sha256(ebs.image) == ebs_before, "the EBS volume was written to"


def test_one_disk_is_used_directly_and_a_foreign_array_is_left_alone(
    kit: qemu.GuestKit, tmp_path: Path
) -> None:
    ebs = ebs_volume(tmp_path)
    aws = instance_store(tmp_path, 7)
    ebs_before = sha256(ebs.image)
    disk = by_id(aws)
    agent = "LOCAL_NVME_CACHE_OWNER=1000:1000 LOCAL_NVME_CACHE_MODE=2775"
    run = boot(
        kit,
        tmp_path,
        "one-disk",
        [ebs, aws],
        f"""
        # Karpenter's instanceStorePolicy: RAID0 makes the AMI's setup-local-disks take the disk.
        step foreign-setup sh -c 'mdadm --create /dev/md/kubernetes --run --force --level=0 \\
            --raid-devices=1 {disk} && mkfs.xfs -q /dev/md/kubernetes \\
            && mkdir -p /mnt/k8s-disks/0 && mount /dev/md/kubernetes /mnt/k8s-disks/0'
        step foreign-run {RUN}
        step foreign-state state
        step foreign-mounts grep -c ' /mnt/k8s-disks/0 ' /proc/self/mountinfo
        step foreign-cleanup sh -c 'umount /mnt/k8s-disks/0 && mdadm --stop /dev/md/kubernetes \\
            && wipefs -a -q {disk}'

        step run-1 env {agent} {RUN}
        step state-1 state
        step run-2 env {agent} {RUN}
        step state-2 state
        step umount umount $MOUNT
        step run-3 {RUN} --cache-owner 1000:1000 --cache-mode 2775
        step state-3 state
        """,
    )
    ok(run, "foreign-setup")
    refused = run["foreign-run"]
    assert refused.rc == 1, refused.output
    assert_not_logged(refused, "unexpected failure")
    assert "leaving /dev/nvme1n1 alone: it belongs to another md array" in refused.output
    assert "setup-local-nvme: error: none of the 1 instance-store disk(s) is usable" in (
        refused.output
    )
    assert "instanceStorePolicy: RAID0" in refused.output
    assert "mount" not in state(ok(run, "foreign-state"))
    assert ok(run, "foreign-mounts").output == "1"
    ok(run, "foreign-cleanup")

    first = ok(run, "run-1")
    assert_logged(
        first,
        "one empty instance-store disk: using /dev/nvme1n1 directly, no array",
        "formatting /dev/nvme1n1 as XFS",
        f"created {CACHE} (owner 1000:1000, mode 2775)",
    )
    one_disk = state(ok(run, "state-1"))
    assert one_disk["md"] == []
    assert one_disk["mount"]["source"] == "/dev/nvme1n1"
    assert "noatime" in one_disk["mount"]["options"].split(",")
    assert one_disk["fs_TYPE"] == "xfs"
    assert one_disk["fs_LABEL"] == "local-nvme"
    assert one_disk["cache"] == "1000:1000 2775"

    assert_logged(ok(run, "run-2"), "everything was already in place")
    assert state(ok(run, "state-2")) == one_disk

    # As after a reboot: the file system is there, not mounted.
    ok(run, "umount")
    remounted = ok(run, "run-3")
    assert_logged(
        remounted,
        "/dev/nvme1n1 already holds our file system (label local-nvme)",
        f"ready: {CACHE} on /dev/nvme1n1 (single disk); changed: mounted /dev/nvme1n1",
    )
    assert state(ok(run, "state-3")) == one_disk
    assert sha256(ebs.image) == ebs_before, "the EBS volume was written to"


def test_no_instance_store_keeps_the_cache_on_the_root_volume(
    kit: qemu.GuestKit, tmp_path: Path
) -> None:
    ebs = ebs_volume(tmp_path)
    ebs_before = sha256(ebs.image)
    run = boot(
        kit,
        tmp_path,
        "no-disks",
        [ebs],
        f"""
        step run-1 {RUN}
        step run-2 {RUN}
        step state state
        step ebs blkid -p -o export /dev/nvme0n1
        """,
        udev=False,
    )
    first = ok(run, "run-1")
    assert_logged(
        first,
        "not instance store, leaving it alone",
        "no instance-store NVMe disks (model 'Amazon EC2 NVMe Instance Storage'): the cache "
        "stays on the root volume",
        f"created {CACHE} (owner 65532:65532, mode 0755)",
    )
    assert_logged(
        ok(run, "run-2"),
        f"ready: {CACHE} on the root volume (no instance store); everything was already in place",
    )
    found = state(ok(run, "state"))
    assert found["md"] == []
    assert "mount" not in found
    assert found["cache"] == "65532:65532 755"
    assert run["ebs"].rc == 2, "blkid found a signature on the EBS volume"
    assert sha256(ebs.image) == ebs_before, "the EBS volume was written to"
