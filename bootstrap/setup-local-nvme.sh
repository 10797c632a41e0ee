#!/usr/bin/env bash
#
# setup-local-nvme: make the model-cache volume of a GPU node from its EC2 instance-store NVMe
# disks: an md RAID-0 over two or more disks (the disk itself when there is one), XFS, mounted by
# UUID with noatime at /mnt/k8s-disks/local-nvme, with the cache directory in it. A node without
# instance-store disks gets the cache directory on its root volume, at the same path.
#
# setup-local-nvme.service runs it on every boot, before containerd and kubelet. Every step looks
# at the real state before it acts, so a second run changes nothing; after a reboot it finds the
# array udev assembled (or assembles it) and mounts it; after an EC2 stop/start, which hands the
# disks back empty, it builds the array again. It only touches disks whose NVMe model matches
# --model-match, never EBS volumes, and never a disk holding anything it did not make.
# See bootstrap/README.md.

set -o errexit -o pipefail -o nounset -o errtrace
shopt -s nullglob

readonly PROG=setup-local-nvme

MODEL_MATCH=${LOCAL_NVME_MODEL_MATCH:-Amazon EC2 NVMe Instance Storage}
ARRAY_NAME=${LOCAL_NVME_ARRAY_NAME:-local-nvme}
FS_LABEL=${LOCAL_NVME_FS_LABEL:-local-nvme}
CHUNK_KIB=${LOCAL_NVME_CHUNK_KIB:-512}
MOUNT_POINT=${LOCAL_NVME_MOUNT_POINT:-/mnt/k8s-disks/local-nvme}
CACHE_DIR=${LOCAL_NVME_CACHE_DIR:-huggingface}
# The agent's uid:gid (DaemonSet runAsUser/runAsGroup, Dockerfile): it writes the cache, and
# mode 0755 lets vLLM, whatever its uid, read it.
CACHE_OWNER=${LOCAL_NVME_CACHE_OWNER:-65532:65532}
CACHE_MODE=${LOCAL_NVME_CACHE_MODE:-0755}

DISKS=()        # instance-store disks (/dev/nvmeXnY)
MEMBERS=()      # ... carrying the superblock of our array
OWN_FS=()       # ... carrying our XFS directly (the one-disk layout)
BLANK=()        # ... carrying no signature at all
ARRAY_DEV=""    # our running array (/dev/mdN)
STALE_ARRAYS=() # arrays of our name that are assembled but not running
VOLUME=""       # the device the cache file system lives on
LAYOUT=""       # how VOLUME came to be, for the log
CHANGES=()      # what this run changed

log() {
  printf '%s: %s\n' "$PROG" "$*" >&2
}

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 1
}

err_report() {
  printf '%s: error: unexpected failure (status %s) at line %s\n' "$PROG" "$2" "$1" >&2
}

trap 'err_report "$LINENO" "$?"' ERR

print_help() {
  cat << EOF
usage: $PROG [options]

Builds the model-cache volume from this node's EC2 instance-store NVMe disks: an md RAID-0
over two or more disks (the disk itself when there is one), formatted XFS when it has no file
system yet, mounted by UUID with noatime, with the cache directory in it. Without such disks it
makes the cache directory on the root volume. Safe to run again: every step checks first.

Options (each has an environment twin; a flag wins over its variable):
  --model-match GLOB   NVMe model (sysfs) of the disks to use   LOCAL_NVME_MODEL_MATCH
                       (now: "$MODEL_MATCH")
  --array-name NAME    md array name                            LOCAL_NVME_ARRAY_NAME
                       (now: $ARRAY_NAME)
  --fs-label LABEL     XFS label, up to 12 characters           LOCAL_NVME_FS_LABEL
                       (now: $FS_LABEL)
  --chunk-kib N        RAID-0 chunk size in KiB                 LOCAL_NVME_CHUNK_KIB
                       (now: $CHUNK_KIB)
  --mount-point DIR    where the volume is mounted              LOCAL_NVME_MOUNT_POINT
                       (now: $MOUNT_POINT)
  --cache-dir PATH     cache directory, relative to DIR         LOCAL_NVME_CACHE_DIR
                       (now: $CACHE_DIR)
  --cache-owner U:G    numeric owner of the cache directory     LOCAL_NVME_CACHE_OWNER
                       (now: $CACHE_OWNER)
  --cache-mode MODE    octal mode of the cache directory        LOCAL_NVME_CACHE_MODE
                       (now: $CACHE_MODE)
  -h, --help           print this help

Exit status: 0 when the cache directory is in place (also on the root volume when the node
has no instance-store disks), 1 on a failure, with the reason on stderr.
EOF
}

need_value() {
  if [[ $# -lt 2 ]]; then
    die "$1 needs a value (see --help)"
  fi
}

parse_args() {
  while [[ $# -gt 0 ]]; do
    case $1 in
      -h | --help)
        print_help
        exit 0
        ;;
      --model-match)
        need_value "$@"
        MODEL_MATCH=$2
        shift 2
        ;;
      --array-name)
        need_value "$@"
        ARRAY_NAME=$2
        shift 2
        ;;
      --fs-label)
        need_value "$@"
        FS_LABEL=$2
        shift 2
        ;;
      --chunk-kib)
        need_value "$@"
        CHUNK_KIB=$2
        shift 2
        ;;
      --mount-point)
        need_value "$@"
        MOUNT_POINT=$2
        shift 2
        ;;
      --cache-dir)
        need_value "$@"
        CACHE_DIR=$2
        shift 2
        ;;
      --cache-owner)
        need_value "$@"
        CACHE_OWNER=$2
        shift 2
        ;;
      --cache-mode)
        need_value "$@"
        CACHE_MODE=$2
        shift 2
        ;;
      *)
        die "unknown argument: $1 (see --help)"
        ;;
    esac
  done
}

validate_args() {
  local component='[A-Za-z0-9_@+-][A-Za-z0-9_.@+-]*'
  if [[ -z $MODEL_MATCH ]]; then
    die "--model-match must not be empty"
  fi
  if [[ ! $ARRAY_NAME =~ ^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,31}$ ]]; then
    die "--array-name: up to 32 letters, digits, '.', '_' or '-': '$ARRAY_NAME'"
  fi
  if [[ ! $FS_LABEL =~ ^[A-Za-z0-9_.-]{1,12}$ ]]; then
    die "--fs-label: up to 12 letters, digits, '.', '_' or '-' (an XFS limit): '$FS_LABEL'"
  fi
  if [[ ! $CHUNK_KIB =~ ^[0-9]{1,7}$ ]] || ((CHUNK_KIB < 4 || (CHUNK_KIB & (CHUNK_KIB - 1)) != 0)); then
    die "--chunk-kib: a power of two, at least 4: '$CHUNK_KIB'"
  fi
  if [[ ! $MOUNT_POINT =~ ^(/$component)+$ ]]; then
    die "--mount-point: an absolute path without '.', '..', spaces or a trailing '/': '$MOUNT_POINT'"
  fi
  if [[ ! $CACHE_DIR =~ ^$component(/$component)*$ ]]; then
    die "--cache-dir: a relative path below the mount point, without '.' or '..': '$CACHE_DIR'"
  fi
  if [[ ! $CACHE_OWNER =~ ^[0-9]+:[0-9]+$ ]]; then
    die "--cache-owner: numeric UID:GID: '$CACHE_OWNER'"
  fi
  if [[ ! $CACHE_MODE =~ ^[0-7]{3,4}$ ]]; then
    die "--cache-mode: an octal mode such as 0755 or 2775: '$CACHE_MODE'"
  fi
}

require() {
  local tool missing=()
  for tool in "$@"; do
    if ! command -v "$tool" > /dev/null; then
      missing+=("$tool")
    fi
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    die "missing programs: ${missing[*]}"
  fi
}

# trim TEXT: print TEXT without leading and trailing whitespace (some kernels pad sysfs strings).
trim() {
  local text=$1
  text=${text#"${text%%[![:space:]]*}"}
  text=${text%"${text##*[![:space:]]}"}
  printf '%s' "$text"
}

# Wait for udev to finish the events it has queued (disks appearing, arrays it assembles).
settle() {
  if command -v udevadm > /dev/null && [[ -e /run/udev/control ]]; then
    udevadm settle --timeout=60 || log "udev did not settle within 60 s; going on"
  fi
}

# Fill DISKS with the NVMe namespaces whose controller reports a model matching MODEL_MATCH.
# The sysfs model decides, not the /dev/nvmeN order: on Nitro instances EBS volumes (the root
# volume among them) are NVMe devices too, and their numbering changes between boots.
find_disks() {
  local block name model serial
  for block in /sys/block/nvme*; do
    name=${block##*/}
    if [[ ! $name =~ ^nvme[0-9]+n[0-9]+$ || ! -r $block/device/model ]]; then
      continue
    fi
    model=$(trim "$(< "$block/device/model")")
    serial=unknown
    if [[ -r $block/device/serial ]]; then
      serial=$(trim "$(< "$block/device/serial")")
    fi
    # shellcheck disable=SC2053 # --model-match is a glob on purpose
    if [[ $model == $MODEL_MATCH ]]; then
      log "/dev/$name (model '$model', serial $serial): instance store"
      DISKS+=("/dev/$name")
    else
      log "/dev/$name (model '$model', serial $serial): not instance store, leaving it alone"
    fi
  done
}

# md_detail DEV KEY: print KEY from `mdadm --detail --export DEV`; fail when it is absent.
md_detail() {
  local output line
  output=$(mdadm --detail --export "$1" 2> /dev/null) || return 1
  while IFS= read -r line; do
    if [[ $line == "$2="* ]]; then
      printf '%s' "${line#*=}"
      return 0
    fi
  done <<< "$output"
  return 1
}

# Arrays record "homehost:name"; ours are created with --homehost=any, which records "any".
is_our_array_name() {
  [[ $1 == "$ARRAY_NAME" || $1 == *":$ARRAY_NAME" ]]
}

# Set ARRAY_DEV to our running array and STALE_ARRAYS to the assembled but not running ones of
# our name (udev puts an array together one disk at a time and starts it when all are there).
# /dev/md/NAME is not trusted: without udev it outlives `mdadm --stop`.
find_arrays() {
  local md dev state name
  ARRAY_DEV=""
  STALE_ARRAYS=()
  for md in /sys/block/md*; do
    dev=/dev/${md##*/}
    if [[ ! -r $md/md/array_state ]] || ! name=$(md_detail "$dev" MD_NAME); then
      continue
    fi
    if ! is_our_array_name "$name"; then
      continue
    fi
    state=$(< "$md/md/array_state")
    case $state in
      clear | inactive)
        STALE_ARRAYS+=("$dev")
        ;;
      *)
        if [[ -n $ARRAY_DEV ]]; then
          die "two running arrays are named $ARRAY_NAME: $ARRAY_DEV and $dev"
        fi
        ARRAY_DEV=$dev
        ;;
    esac
  done
}

maybe_stop_stale_arrays() {
  local dev
  for dev in "${STALE_ARRAYS[@]}"; do
    log "$dev ($ARRAY_NAME) is assembled but not running: stopping it to assemble it again"
    mdadm --stop "$dev" || die "could not stop $dev"
  done
}

# Remove /dev/md/NAME when it does not lead to our running array, so mdadm can make it again.
maybe_remove_stale_link() {
  local link=/dev/md/$ARRAY_NAME target
  if [[ ! -L $link ]]; then
    return 0
  fi
  target=$(readlink -f "$link")
  if [[ -n $ARRAY_DEV && $target == "$ARRAY_DEV" ]]; then
    return 0
  fi
  log "$link -> $target is stale (no running array $ARRAY_NAME there): removing the link"
  rm -f "$link"
}

# probe DEV: set PROBE_TYPE, PROBE_LABEL and PROBE_UUID from blkid's low-level probe of the device
# itself (not its cache). PROBE_TYPE is empty when DEV holds no signature at all.
probe() {
  local output status=0 key value pttype=""
  PROBE_TYPE=""
  PROBE_LABEL=""
  PROBE_UUID=""
  output=$(blkid -p -o export "$1") || status=$?
  case $status in
    0) ;;
    2) return 0 ;; # nothing found
    *)
      PROBE_TYPE="signatures blkid cannot tell apart (status $status)"
      return 0
      ;;
  esac
  while IFS='=' read -r key value; do
    case $key in
      TYPE) PROBE_TYPE=$value ;;
      PTTYPE) pttype=$value ;;
      LABEL) PROBE_LABEL=$value ;;
      UUID) PROBE_UUID=$value ;;
    esac
  done <<< "$output"
  if [[ -z $PROBE_TYPE && -n $pttype ]]; then
    PROBE_TYPE="a $pttype partition table"
  fi
}

# busy_reason NAME: print why the blank disk NAME is in use anyway; fail when it is not.
busy_reason() {
  local entry majmin mounted _ swap
  for entry in "/sys/block/$1/holders/"*; do
    printf 'held by %s' "${entry##*/}"
    return 0
  done
  for entry in "/sys/block/$1/$1"p*; do
    printf 'has partition %s' "${entry##*/}"
    return 0
  done
  majmin=$(< "/sys/block/$1/dev")
  while read -r _ _ mounted _; do
    if [[ $mounted == "$majmin" ]]; then
      printf 'mounted'
      return 0
    fi
  done < /proc/self/mountinfo
  while read -r swap _; do
    if [[ $swap == "/dev/$1" ]]; then
      printf 'used as swap'
      return 0
    fi
  done < /proc/swaps
  return 1
}

# Sort the instance-store disks that are not in our running array into MEMBERS, OWN_FS and
# BLANK. A disk holding anything else (another array, another file system, a partition table)
# or in use is left alone: this script only ever writes to disks that are empty.
classify_disks() {
  local dev name reason
  for dev in "${DISKS[@]}"; do
    name=${dev#/dev/}
    if [[ -n $ARRAY_DEV && -e /sys/block/${ARRAY_DEV#/dev/}/slaves/$name ]]; then
      continue
    fi
    probe "$dev"
    case $PROBE_TYPE in
      "")
        if reason=$(busy_reason "$name"); then
          log "leaving $dev alone: it has no signature but is $reason"
        else
          BLANK+=("$dev")
        fi
        ;;
      linux_raid_member)
        if is_our_array_name "$PROBE_LABEL"; then
          MEMBERS+=("$dev")
        else
          log "leaving $dev alone: it belongs to another md array ('$PROBE_LABEL')"
        fi
        ;;
      xfs)
        if [[ $PROBE_LABEL == "$FS_LABEL" ]]; then
          OWN_FS+=("$dev")
        else
          log "leaving $dev alone: it holds an XFS file system labelled '$PROBE_LABEL', not ours"
        fi
        ;;
      *)
        log "leaving $dev alone: it holds $PROBE_TYPE"
        ;;
    esac
  done
}

assemble_array() {
  require mdadm
  maybe_remove_stale_link
  log "assembling array $ARRAY_NAME from ${#MEMBERS[@]} disk(s): ${MEMBERS[*]}"
  if ! mdadm --assemble --run "/dev/md/$ARRAY_NAME" "${MEMBERS[@]}"; then
    die "could not assemble $ARRAY_NAME from ${MEMBERS[*]} (a disk missing or failed?);" \
      "it only holds a cache: to rebuild it, stop the array, 'wipefs -a' its disks, run $PROG again"
  fi
  CHANGES+=("assembled array $ARRAY_NAME")
}

create_array() {
  require mdadm
  maybe_remove_stale_link
  log "creating RAID-0 array $ARRAY_NAME (chunk $CHUNK_KIB KiB) over ${#BLANK[@]} empty disks:" \
    "${BLANK[*]}"
  # --homehost=any keeps the array's name (and /dev/md/NAME) when the hostname changes.
  if ! mdadm --create "/dev/md/$ARRAY_NAME" --run --level=0 --metadata=1.2 \
    --raid-devices="${#BLANK[@]}" --chunk="${CHUNK_KIB}K" \
    --name="$ARRAY_NAME" --homehost=any "${BLANK[@]}"; then
    die "mdadm could not create the array over ${BLANK[*]}"
  fi
  CHANGES+=("created array $ARRAY_NAME")
}

# Set VOLUME: our running array, else the array assembled from its disks, else our one-disk file
# system, else a new array over the empty disks (or the one empty disk itself).
choose_volume() {
  local disk
  if [[ -n $ARRAY_DEV ]]; then
    log "array $ARRAY_NAME is already running as $ARRAY_DEV"
  elif [[ ${#MEMBERS[@]} -gt 0 ]]; then
    assemble_array
  elif [[ ${#OWN_FS[@]} -gt 0 ]]; then
    VOLUME=${OWN_FS[0]}
    LAYOUT="single disk"
    log "$VOLUME already holds our file system (label $FS_LABEL): using the disk directly"
    return 0
  elif [[ ${#BLANK[@]} -ge 2 ]]; then
    create_array
  elif [[ ${#BLANK[@]} -eq 1 ]]; then
    VOLUME=${BLANK[0]}
    LAYOUT="single disk"
    log "one empty instance-store disk: using $VOLUME directly, no array"
    return 0
  else
    die "none of the ${#DISKS[@]} instance-store disk(s) is usable (see above). If Karpenter's" \
      "instanceStorePolicy: RAID0 is set, the AMI's setup-local-disks owns them: use one or" \
      "the other, never both (bootstrap/README.md)"
  fi
  settle
  find_arrays
  if [[ -z $ARRAY_DEV ]]; then
    die "array $ARRAY_NAME is not running after mdadm finished"
  fi
  VOLUME=$ARRAY_DEV
  LAYOUT="RAID-0 of $(md_detail "$ARRAY_DEV" MD_DEVICES || echo '?') disks"
  for disk in "${BLANK[@]}"; do
    if [[ ! -e /sys/block/${ARRAY_DEV#/dev/}/slaves/${disk#/dev/} ]]; then
      log "not using empty disk $disk: it is not part of array $ARRAY_NAME"
    fi
  done
}

maybe_mkfs() {
  local dev=$1 chunk options=()
  probe "$dev"
  if [[ $PROBE_TYPE == xfs ]]; then
    log "$dev already has an XFS file system (UUID $PROBE_UUID)"
    return 0
  fi
  if [[ -n $PROBE_TYPE ]]; then
    die "$dev holds $PROBE_TYPE, not XFS: refusing to format it"
  fi
  require mkfs.xfs
  if [[ -r /sys/block/${dev#/dev/}/md/chunk_size ]]; then
    chunk=$(< "/sys/block/${dev#/dev/}/md/chunk_size")
    # The XFS log stripe unit may not exceed 256 KiB; mkfs.xfs would say so and use 32 KiB.
    if ((chunk > 262144)); then
      options+=(-l su=32k)
    fi
  fi
  # -K: no discard at mkfs time; instance store comes trimmed and discarding is slow.
  log "formatting $dev as XFS (label $FS_LABEL)"
  if ! mkfs.xfs -q -K -L "$FS_LABEL" "${options[@]}" "$dev"; then
    die "mkfs.xfs failed on $dev"
  fi
  CHANGES+=("formatted $dev")
}

# mounted_majmin DIR: print major:minor of the file system on top of DIR, nothing if none.
mounted_majmin() {
  local _ majmin target found=""
  while read -r _ _ majmin _ target _; do
    if [[ $target == "$1" ]]; then
      found=$majmin
    fi
  done < /proc/self/mountinfo
  printf '%s' "$found"
}

maybe_mount() {
  local dev=$1 want have
  want=$(< "/sys/class/block/${dev#/dev/}/dev")
  have=$(mounted_majmin "$MOUNT_POINT")
  if [[ $have == "$want" ]]; then
    log "$dev is already mounted at $MOUNT_POINT"
    return 0
  fi
  if [[ -n $have ]]; then
    die "$MOUNT_POINT is already a mount of another device ($have), not of $dev ($want)"
  fi
  probe "$dev"
  if [[ $PROBE_TYPE != xfs || -z $PROBE_UUID ]]; then
    die "no XFS file system with a UUID on $dev"
  fi
  maybe_dir "$MOUNT_POINT" 0755 0:0
  log "mounting $dev (UUID=$PROBE_UUID) at $MOUNT_POINT with noatime"
  if ! mount -t xfs -o noatime "UUID=$PROBE_UUID" "$MOUNT_POINT"; then
    die "could not mount UUID=$PROBE_UUID at $MOUNT_POINT"
  fi
  have=$(mounted_majmin "$MOUNT_POINT")
  if [[ $have != "$want" ]]; then
    die "after mounting, $MOUNT_POINT is $have, not $dev ($want)"
  fi
  CHANGES+=("mounted $dev")
}

# maybe_dir DIR MODE UID:GID: create DIR, or set its owner and mode when they differ.
maybe_dir() {
  local dir=$1 mode=$2 owner=$3 want have
  want="$owner $(printf '%o' "$((8#$mode))")"
  if [[ ! -d $dir ]]; then
    if [[ -e $dir || -L $dir ]]; then
      die "$dir exists and is not a directory"
    fi
    install -d -m "$mode" -o "${owner%:*}" -g "${owner#*:}" "$dir"
    log "created $dir (owner $owner, mode $mode)"
    CHANGES+=("created $dir")
    return 0
  fi
  have=$(stat -c '%u:%g %a' "$dir")
  if [[ $have == "$want" ]]; then
    log "$dir is in place (owner $owner, mode $mode)"
    return 0
  fi
  chown "$owner" "$dir"
  chmod "$mode" "$dir"
  log "set owner and mode of $dir to $want (they were $have)"
  CHANGES+=("fixed $dir")
}

report() {
  local summary="everything was already in place"
  if [[ ${#CHANGES[@]} -gt 0 ]]; then
    summary=$(printf '%s, ' "${CHANGES[@]}")
    summary="changed: ${summary%, }"
  fi
  log "ready: $MOUNT_POINT/$CACHE_DIR on $VOLUME ($LAYOUT); $summary"
}

main() {
  parse_args "$@"
  validate_args
  if [[ $EUID -ne 0 ]]; then
    die "must run as root"
  fi
  require blkid mount install stat
  settle
  find_disks
  if [[ ${#DISKS[@]} -eq 0 ]]; then
    log "no instance-store NVMe disks (model '$MODEL_MATCH'): the cache stays on the root volume"
    maybe_dir "$MOUNT_POINT/$CACHE_DIR" "$CACHE_MODE" "$CACHE_OWNER"
    VOLUME="the root volume"
    LAYOUT="no instance store"
    report
    return 0
  fi
  find_arrays
  if [[ ${#STALE_ARRAYS[@]} -gt 0 ]]; then
    maybe_stop_stale_arrays
    find_arrays
  fi
  classify_disks
  choose_volume
  maybe_mkfs "$VOLUME"
  maybe_mount "$VOLUME"
  maybe_dir "$MOUNT_POINT/$CACHE_DIR" "$CACHE_MODE" "$CACHE_OWNER"
  report
}

main "$@"
