"""Boot the Debian kernel in QEMU with a hand-made initramfs, to run bootstrap/ scripts for real.

The host kernel has no md RAID driver, so the node bootstrap is tested inside a guest:

* :func:`build_initramfs` gathers busybox, bash and the real programs a node runs the script with
  (mdadm, xfsprogs, util-linux, GNU coreutils, kmod, udev), with the libraries ``ldd`` names, and
  the kernel modules for NVMe, md RAID-0 and XFS, into one uncompressed ``newc`` archive. Build it
  once per test session: it takes a few seconds.
* :func:`boot` appends a second archive holding the files of one boot (the project's script, a
  scenario), attaches sparse raw images as emulated NVMe disks, and returns what the guest printed
  on its serial console, split into the steps the scenario reported (:class:`GuestRun`).

QEMU's NVMe controller has no model property (it always reads "QEMU NVMe Ctrl"), so the guest's
``/init`` bind-mounts a file over each controller's sysfs ``model`` attribute, chosen from the
disk's serial the way EC2 names disks: a serial starting with ``AWS`` is an instance-store disk
("Amazon EC2 NVMe Instance Storage"), one starting with ``vol`` an EBS volume ("Amazon Elastic
Block Store"). udev (when the guest runs it) then names ``/dev/disk/by-id/`` links after them too.

A scenario is a bash script; ``step NAME COMMAND...`` runs a command and frames its output and exit
status on the console. The guest powers off when the scenario ends; a boot that does not finish
within its timeout is killed.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DISK_SIZE",
    "Disk",
    "GuestKit",
    "GuestRun",
    "Step",
    "boot",
    "build_initramfs",
    "make_disk",
    "missing_requirements",
    "wipe_disk",
]

#: Size of an emulated disk. XFS refuses file systems under 300 MB; the images are sparse.
DISK_SIZE = 320 * 1024 * 1024
#: Hard limit for one boot (TCG boots take 12-20 s plus the scenario; a noisy host is slower).
BOOT_TIMEOUT_S = 240.0

_SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MODULES = ("nvme", "md_mod", "raid0", "xfs")
#: Programs the guest gets from the host (busybox supplies everything else). The script under test
#: runs with the same GNU coreutils, util-linux, mdadm and xfsprogs a node has, not with busybox's.
_REQUIRED_PROGRAMS = ("bash", "mdadm", "mkfs.xfs", "blkid", "mount", "umount", "modprobe")
_OPTIONAL_PROGRAMS = (
    "findmnt",
    "mountpoint",
    "lsblk",
    "wipefs",
    "nvme",
    "udevadm",
    "base64",
    "basename",
    "cat",
    "chmod",
    "chown",
    "cmp",
    "cut",
    "dd",
    "dirname",
    "grep",
    "head",
    "id",
    "install",
    "ln",
    "ls",
    "mkdir",
    "mv",
    "readlink",
    "realpath",
    "rm",
    "sed",
    "sha256sum",
    "sleep",
    "sort",
    "stat",
    "sync",
    "tail",
    "touch",
    "tr",
    "wc",
)
_UDEV_RULES = (
    "50-udev-default.rules",
    "60-block.rules",
    "60-persistent-storage.rules",
    "63-md-raid-arrays.rules",
    "64-md-raid-assembly.rules",
)

_INIT = r"""#!/bin/sh
# /init of the bootstrap test guest (written by tests/guest/qemu.py).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
ln -s /proc/self/fd /dev/fd
mkdir -p /run /tmp
mount -t tmpfs -o mode=0755 tmpfs /run
. /guest/boot.env

for module in nvme md_mod raid0 xfs; do
    modprobe "$module" || echo "@@INIT modprobe $module failed"
done

# The NVMe driver probes controllers and scans their namespaces asynchronously.
count_disks() { ls -d /sys/block/nvme*n* 2>/dev/null | wc -l; }
tries=0
while [ "$(count_disks)" -lt "$GUEST_DISKS" ]; do
    tries=$((tries + 1))
    if [ "$tries" -gt 300 ]; then
        echo "@@INIT only $(count_disks) of $GUEST_DISKS NVMe disks appeared"
        break
    fi
    sleep 0.1
done

# QEMU's controller has no model property: show the model EC2 would, chosen from the serial.
# (Older kernels pad the attribute with spaces; the script must not care.)
mkdir -p /run/guest-model
for ctrl in /sys/class/nvme/nvme*; do
    [ -e "$ctrl/serial" ] || continue
    serial=$(tr -d ' ' <"$ctrl/serial")
    case $serial in
        AWS*) model="Amazon EC2 NVMe Instance Storage" ;;
        vol*) model="Amazon Elastic Block Store" ;;
        *) continue ;;
    esac
    printf '%-40s\n' "$model" >"/run/guest-model/${ctrl##*/}"
    mount --bind "/run/guest-model/${ctrl##*/}" "$ctrl/model"
done

if [ "$GUEST_UDEV" = 1 ]; then
    mkdir -p /run/udev
    /usr/lib/systemd/systemd-udevd --daemon --resolve-names=never
    udevadm trigger --type=subsystems --action=add
    udevadm trigger --type=devices --action=add
    udevadm settle --timeout=60
fi

echo "@@READY"
bash /guest/scenario.sh
echo "@@SCENARIO-END rc=$?"
sync
poweroff -f
"""

_LIB = r"""# Sourced by /guest/scenario.sh (written by tests/guest/qemu.py).
# step NAME COMMAND...: run COMMAND and frame its output and exit status for the test to parse.
step() {
    local name=$1 rc=0
    shift
    echo "@@BEGIN $name"
    "$@" 2>&1 || rc=$?
    echo "@@END $name rc=$rc"
}
"""


@dataclass(frozen=True)
class GuestKit:
    """A kernel and the base initramfs built for it."""

    kernel: Path
    kver: str
    initramfs: Path
    has_udev: bool


@dataclass(frozen=True)
class Disk:
    """A raw image attached as its own NVMe controller; the serial decides the model (see above)."""

    image: Path
    serial: str


@dataclass
class Step:
    name: str
    rc: int
    output: str


@dataclass
class GuestRun:
    """What one boot printed. ``run["name"]`` returns a step or fails with the console's tail."""

    name: str
    console: str
    log: Path
    seconds: float
    timed_out: bool
    scenario_rc: int | None
    steps: dict[str, Step] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Step:
        if name not in self.steps:
            raise AssertionError(f"step {name!r} not reported by boot {self.name!r}\n{self.tail()}")
        return self.steps[name]

    def tail(self, lines: int = 80) -> str:
        state = "timed out" if self.timed_out else f"scenario rc={self.scenario_rc}"
        text = "\n".join(self.console.splitlines()[-lines:])
        return f"--- console of boot {self.name!r} ({state}, log {self.log}) ---\n{text}"

    def check_finished(self) -> None:
        """Fail unless the guest ran the whole scenario and powered off."""
        if self.timed_out or self.scenario_rc is None:
            raise AssertionError(f"boot {self.name!r} did not finish\n{self.tail()}")


# --- host requirements -----------------------------------------------------------------------


def _which(program: str) -> str | None:
    return shutil.which(program, path=_SEARCH_PATH)


def find_kernel() -> tuple[Path, str] | None:
    """The newest ``/boot/vmlinuz-*`` whose modules are installed, with its version."""
    found = []
    for kernel in Path("/boot").glob("vmlinuz-*"):
        kver = kernel.name.removeprefix("vmlinuz-")
        if (Path("/lib/modules") / kver / "modules.dep").is_file():
            found.append((kernel, kver))
    if not found:
        return None
    return max(found, key=lambda item: [int(n) for n in re.findall(r"\d+", item[1])])


def missing_requirements() -> str | None:
    """Why a guest cannot be booted here (a skip reason), or None."""
    programs = ("qemu-system-x86_64", "busybox", "ldd", "depmod", *_REQUIRED_PROGRAMS)
    absent = [program for program in programs if _which(program) is None]
    if absent:
        return f"missing on the host: {', '.join(absent)} (see .ci/apt-packages)"
    kernel = find_kernel()
    if kernel is None:
        return "no /boot/vmlinuz-* with matching /lib/modules (apt-get install linux-image-amd64)"
    if not os.access(kernel[0], os.R_OK):
        return f"{kernel[0]} is not readable by this user"
    return None


def _accel_args() -> list[str]:
    """TCG unless the CPU shows hardware virtualization (KVM under a paravirtual host aborts)."""
    forced = os.environ.get("PREFETCH_TEST_QEMU_ACCEL")
    if forced == "kvm" or (forced is None and _kvm_usable()):
        return ["-accel", "kvm", "-cpu", "host"]
    return ["-accel", "tcg", "-cpu", "max"]


def _kvm_usable() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"^flags\s*:.*\b(vmx|svm)\b", flags, re.M)) and os.access(
        "/dev/kvm", os.R_OK | os.W_OK
    )


# --- the initramfs -----------------------------------------------------------------------------


class _Newc:
    """Writes a ``newc`` cpio archive, the format the kernel unpacks into its first root."""

    def __init__(self, first_inode: int) -> None:
        self._chunks: list[bytes] = []
        self._inode = first_inode

    def add(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        encoded = name.encode() + b"\0"
        self._inode += 1
        fields = (self._inode, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(encoded), 0)
        header = ("070701" + "".join(f"{value:08X}" for value in fields)).encode()
        self._chunks += [header, encoded, _pad4(len(header) + len(encoded)), data, _pad4(len(data))]

    def add_dirs(self, path: str) -> None:
        parts = path.strip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            self.add("/".join(parts[:depth]), stat.S_IFDIR | 0o755)

    def add_tree(self, root: Path) -> None:
        for current, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                path = Path(current, name)
                info = path.lstat()
                rel = str(path.relative_to(root))
                if stat.S_ISLNK(info.st_mode):
                    self.add(rel, stat.S_IFLNK | 0o777, os.readlink(path).encode())
                elif stat.S_ISDIR(info.st_mode):
                    self.add(rel, stat.S_IFDIR | 0o755)
                else:
                    self.add(rel, stat.S_IFREG | (info.st_mode & 0o777), path.read_bytes())

    def finish(self) -> bytes:
        self.add("TRAILER!!!", 0)
        data = b"".join(self._chunks)
        return data + b"\0" * (-len(data) % 512)


def _pad4(length: int) -> bytes:
    return b"\0" * (-length % 4)


def _copy_into(root: Path, src: Path) -> None:
    """Copy ``src`` to the same path under ``root``, recreating symlinks on the way."""
    dest = root / src.relative_to("/")
    if dest.exists() or dest.is_symlink():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        target = os.readlink(src)
        dest.symlink_to(target)
        _copy_into(root, Path(os.path.normpath(src.parent / target)))
    else:
        shutil.copyfile(src, dest)
        dest.chmod(src.stat().st_mode & 0o755)


def _libraries(program: Path) -> list[Path]:
    result = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=False)
    libs = []
    for line in result.stdout.splitlines():
        match = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if match:
            libs.append(Path(match.group(1)))
    return libs


def _install_program(root: Path, program: str) -> None:
    path = Path(program)
    _copy_into(root, path)
    for lib in _libraries(path.resolve()):
        _copy_into(root, lib)


def _install_modules(root: Path, kver: str) -> None:
    for module in _MODULES:
        result = subprocess.run(
            ["modprobe", "-S", kver, "--show-depends", module],
            capture_output=True,
            text=True,
            check=True,
        )
        for line in result.stdout.splitlines():
            if line.startswith("insmod "):
                _copy_into(root, Path(line.split()[1]))
    moddir = Path("/lib/modules") / kver
    for name in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
        if (moddir / name).is_file():
            _copy_into(root, moddir / name)
    subprocess.run(["depmod", "-b", str(root), kver], check=True)


def _install_udev(root: Path) -> bool:
    udevadm = _which("udevadm")
    rules_dir = next(
        (d for d in (Path("/usr/lib/udev/rules.d"), Path("/lib/udev/rules.d")) if d.is_dir()), None
    )
    if udevadm is None or rules_dir is None:
        return False
    (root / "usr/lib/systemd").mkdir(parents=True, exist_ok=True)
    (root / "usr/lib/systemd/systemd-udevd").symlink_to(os.path.realpath(udevadm))
    for name in _UDEV_RULES:
        if (rules_dir / name).is_file():
            dest = root / "usr/lib/udev/rules.d" / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(rules_dir / name, dest)
    return True


def build_initramfs(workdir: Path) -> GuestKit:
    """Build the base initramfs in ``workdir`` (needs :func:`missing_requirements` to be None)."""
    kernel, kver = find_kernel() or (None, None)
    if kernel is None or kver is None:
        raise RuntimeError("no kernel with modules in /boot")
    root = workdir / "root"
    for sub in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/local/sbin", "usr/local/bin"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "sbin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    for sub in ("dev", "proc", "sys", "run", "tmp", "mnt", "etc", "guest", "root"):
        (root / sub).mkdir(exist_ok=True)

    for program in _REQUIRED_PROGRAMS + _OPTIONAL_PROGRAMS:
        found = _which(program)
        if found is not None:
            _install_program(root, found)
    has_udev = _install_udev(root)

    busybox = _which("busybox")
    assert busybox is not None
    shutil.copyfile(os.path.realpath(busybox), root / "usr/bin/busybox")
    (root / "usr/bin/busybox").chmod(0o755)
    for lib in _libraries(Path(busybox).resolve()):  # none for busybox-static
        _copy_into(root, lib)
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        if not any((root / d / applet).exists() for d in ("usr/bin", "usr/sbin")):
            (root / "usr/bin" / applet).symlink_to("busybox")

    _install_modules(root, kver)
    (root / "etc/mdadm").mkdir(exist_ok=True)
    (root / "init").write_text(_INIT)
    (root / "init").chmod(0o755)
    (root / "guest/lib.sh").write_text(_LIB)

    archive = _Newc(first_inode=0x10000)
    archive.add("dev", stat.S_IFDIR | 0o755)
    archive.add("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1))
    archive.add_tree(root)
    initramfs = workdir / "base.cpio"
    initramfs.write_bytes(archive.finish())
    shutil.rmtree(root)
    return GuestKit(kernel=kernel, kver=kver, initramfs=initramfs, has_udev=has_udev)


# --- disks and boots ---------------------------------------------------------------------------


def make_disk(path: Path, size: int = DISK_SIZE, head: bytes = b"") -> Path:
    """Create a sparse image of ``size`` bytes, optionally starting with ``head``."""
    with path.open("wb") as image:
        image.write(head)
        image.truncate(size)
    return path


def wipe_disk(path: Path) -> None:
    """Zero an image the way EC2 hands back instance-store disks after a stop/start."""
    size = path.stat().st_size
    with path.open("r+b") as image:
        image.truncate(0)
        image.truncate(size)


def _drive_args(disks: Sequence[Disk]) -> Iterable[str]:
    for index, disk in enumerate(disks):
        if len(disk.serial) > 20:
            raise ValueError(f"QEMU takes NVMe serials of up to 20 characters: {disk.serial}")
        image = str(disk.image).replace(",", ",,")
        yield from (
            "-drive",
            f"file={image},if=none,id=disk{index},format=raw,cache=unsafe",
            "-device",
            f"nvme,drive=disk{index},serial={disk.serial}",
        )


def boot(
    kit: GuestKit,
    *,
    name: str,
    workdir: Path,
    disks: Sequence[Disk],
    scenario: str,
    files: Mapping[str, bytes] | None = None,
    udev: bool = True,
    timeout: float = BOOT_TIMEOUT_S,
    memory_mib: int = 768,
) -> GuestRun:
    """Boot once with ``disks`` attached and ``files`` (guest path -> bytes, mode 0755) added,
    run ``scenario`` (bash, with ``step`` defined) and return the console split into steps."""
    if udev and not kit.has_udev:
        raise RuntimeError("the initramfs was built without udev")
    overlay = _Newc(first_inode=0x100000)
    extra = dict(files or {})
    extra["/guest/scenario.sh"] = ("source /guest/lib.sh\n" + scenario).encode()
    extra["/guest/boot.env"] = f"GUEST_DISKS={len(disks)}\nGUEST_UDEV={int(udev)}\n".encode()
    for path, data in sorted(extra.items()):
        overlay.add_dirs(path)
        overlay.add(path.strip("/"), stat.S_IFREG | 0o755, data)
    initrd = workdir / f"{name}.initrd"
    initrd.write_bytes(kit.initramfs.read_bytes() + overlay.finish())

    command = [
        "qemu-system-x86_64",
        *_accel_args(),
        "-smp",
        "2",
        "-m",
        str(memory_mib),
        "-nographic",
        "-no-reboot",
        "-nic",
        "none",
        "-kernel",
        str(kit.kernel),
        "-initrd",
        str(initrd),
        "-append",
        "console=ttyS0 panic=-1 quiet loglevel=3 mitigations=off",
        *_drive_args(disks),
    ]
    log = workdir / f"{name}.log"
    timed_out = False
    started = time.monotonic()
    with (
        log.open("wb") as out,
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out) as qemu,
    ):
        try:
            qemu.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            qemu.kill()
            qemu.wait()
    seconds = time.monotonic() - started
    initrd.unlink()
    console = log.read_bytes().decode("utf-8", "replace").replace("\r", "")
    return _parse(name, console, log, seconds, timed_out)


_BEGIN = re.compile(r"^@@BEGIN (\S+)$")
_END = re.compile(r"^@@END (\S+) rc=(\d+)$")
_SCENARIO_END = re.compile(r"^@@SCENARIO-END rc=(\d+)$")


def _parse(name: str, console: str, log: Path, seconds: float, timed_out: bool) -> GuestRun:
    run = GuestRun(
        name=name, console=console, log=log, seconds=seconds, timed_out=timed_out, scenario_rc=None
    )
    current: str | None = None
    lines: list[str] = []
    for line in console.splitlines():
        if begin := _BEGIN.match(line):
            current, lines = begin.group(1), []
        elif (end := _END.match(line)) and end.group(1) == current:
            if current in run.steps:
                raise AssertionError(f"boot {name!r}: step {current!r} reported twice")
            run.steps[current] = Step(name=current, rc=int(end.group(2)), output="\n".join(lines))
            current = None
        elif done := _SCENARIO_END.match(line):
            run.scenario_rc = int(done.group(1))
        elif current is not None:
            lines.append(line)
    return run
