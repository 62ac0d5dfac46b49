#!/usr/bin/env bash
# numactl-bind-socket.sh — run a command on one CPU socket (package) and its memory, however many NUMA nodes
# the socket has (SNC / NPS / Magny-Cours style machines split one socket into 2-4 nodes).
#
# Usage:
#   numactl-bind-socket.sh --socket ID --mode physical|all [--interleave on|off] [--dry-run] [--] COMMAND [ARG...]
#
#   --socket ID         the socket's physical_package_id as sysfs shows it (usually 0, 1, ...; some machines
#                       use other numbers, e.g. 36 and 8442 on a Kunpeng 920: the error lists the ids)
#   --mode physical     one hardware thread per physical core (the lowest-numbered online thread of each core)
#   --mode all          every online hardware thread of the socket
#   --interleave off    (default) memory bound to the socket's NUMA nodes:        numactl --membind=NODES
#   --interleave on     memory interleaved page by page over the socket's nodes:  numactl --interleave=NODES
#   --dry-run           print the numactl command line (shell-quoted, one line) instead of running it
#
# It runs:  numactl --physcpubind=CPUS (--membind=NODES | --interleave=NODES) -- COMMAND [ARG...]
# with `exec`, so COMMAND replaces this script and gets every signal sent to it directly.
# CPUs are given with --physcpubind (not --cpunodebind) so the binding is exactly the socket even where one
# NUMA node spans two sockets. The socket's nodes are the online nodes whose CPUs include one of the socket's
# online CPUs and which have memory (node/has_memory, else node/has_normal_memory); CPU-less nodes (HBM,
# CXL, GPU memory) are not included.
#
# It reads (relative to $SYSFS_ROOT, default /sys):
#   devices/system/cpu/online (else cpuN/online), cpuN/topology/physical_package_id,
#   cpuN/topology/core_cpus_list (else thread_siblings_list, else the core_cpus/thread_siblings masks),
#   devices/system/node/online (else the nodeN directories), nodeN/cpulist (else nodeN/cpumap),
#   devices/system/node/has_memory (else has_normal_memory).
#
# On the live machine (SYSFS_ROOT unset or /sys) the CPUs and nodes are limited to those this process may use
# (Cpus_allowed_list / Mems_allowed_list in /proc/self/status: a container's cpuset, taskset); a socket with
# nothing left is an error.
#
# Environment
#   SYSFS_ROOT   the sysfs directory to read (default /sys); point it at a recorded dump's sys/ to test.
#   NUMACTL      the numactl program (default numactl, looked up in PATH); not needed with --dry-run.
#
# Errors (bad option, unknown socket, numactl missing, nothing to bind to) print one line on stderr and exit 2.
# Part of orchestrator; usable on its own. Needs bash >= 4.3.

set -euo pipefail

PROG=${0##*/}
SYS=${SYSFS_ROOT:-/sys}
NUMACTL=${NUMACTL:-numactl}

usage() {
    local line
    while IFS= read -r line; do
        [[ $line == '#!'* ]] && continue
        [[ $line == '#'* ]] || break
        line=${line#\#}
        printf '%s\n' "${line# }"
    done <"$0"
}

die() { printf '%s: %s\n' "$PROG" "$*" >&2; exit 2; }

# --- reading sysfs. Helpers set globals (LINE, LIST, RES) instead of printing: no subshell per file, which
# --- matters on a 2-socket x 128-thread machine.

LINE='' LIST='' RES=''

read_first_line() {  # read_first_line FILE: LINE=its first line; fails if unreadable
    LINE=""
    [[ -r $1 ]] || return 1
    { IFS= read -r LINE <"$1"; } 2>/dev/null || [[ -n $LINE ]]
}

expand_list() {  # expand_list "0-3,8,10-11": LIST="0 1 2 3 8 10 11"; fails on a malformed list
    local item lo hi items=()
    local -a out=()
    IFS=, read -r -a items <<<"$1"
    for item in "${items[@]}"; do
        item=${item//[[:space:]]/}
        [[ -n $item ]] || continue
        if [[ $item =~ ^([0-9]+)-([0-9]+)$ ]]; then
            lo=${BASH_REMATCH[1]} hi=${BASH_REMATCH[2]}
            while ((lo <= hi)); do out+=("$lo"); lo=$((lo + 1)); done
        elif [[ $item =~ ^[0-9]+$ ]]; then
            out+=("$item")
        else
            return 1
        fi
    done
    LIST=${out[*]:-}
}

expand_mask() {  # expand_mask "00000000,00000011": LIST="0 4" (32-bit words, most significant first)
    local -a words=() out=()
    local i w bit base n
    IFS=, read -r -a words <<<"${1//[[:space:]]/}"
    n=${#words[@]}
    for ((i = n - 1; i >= 0; i--)); do
        w=${words[i]}
        [[ $w =~ ^[0-9a-fA-F]+$ ]] || return 1
        w=$((16#$w))
        base=$(((n - 1 - i) * 32))
        for ((bit = 0; bit < 32; bit++)); do
            if (((w >> bit) & 1)); then out+=("$((base + bit))"); fi
        done
    done
    LIST=${out[*]:-}
}

read_set() {  # read_set DIR NAME...: LIST=the set in the first readable DIR/NAME (*list: a list, else a mask)
    local dir=$1 name
    shift
    for name in "$@"; do
        if read_first_line "$dir/$name"; then
            if [[ $name == *list ]]; then expand_list "$LINE"; else expand_mask "$LINE"; fi
            return
        fi
    done
    return 1
}

compress() {  # compress "0 1 2 3 8 10 11" (ascending): RES="0-3,8,10-11"
    local start="" prev="" x
    RES=""
    for x in $1 ""; do                                   # the empty sentinel flushes the last range
        if [[ -n $x && -n $prev && $x -eq $((prev + 1)) ]]; then prev=$x; continue; fi
        if [[ -n $start ]]; then
            RES+=${RES:+,}$start
            if [[ $prev != "$start" ]]; then RES+=-$prev; fi
        fi
        start=$x prev=$x
    done
}

# print an argv as one shell-quoted line (plain words stay plain, commas included)
print_argv() {
    local a sep=""
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./=,:+@%-]+$ ]]; then printf '%s%s' "$sep" "$a"; else printf '%s%q' "$sep" "$a"; fi
        sep=" "
    done
    printf '\n'
}

# --- arguments ---------------------------------------------------------------------------------------

socket="" mode="" interleave=off dry_run=0
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --socket) (($# >= 2)) || die "--socket needs a value"; socket=$2; shift 2 ;;
        --socket=*) socket=${1#*=}; shift ;;
        --mode) (($# >= 2)) || die "--mode needs a value (physical or all)"; mode=$2; shift 2 ;;
        --mode=*) mode=${1#*=}; shift ;;
        --interleave) (($# >= 2)) || die "--interleave needs a value (on or off)"; interleave=$2; shift 2 ;;
        --interleave=*) interleave=${1#*=}; shift ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option '$1' (try --help)" ;;
        *) break ;;
    esac
done

[[ -n $socket ]] || die "--socket ID is required (try --help)"
[[ $socket =~ ^-?[0-9]+$ ]] || die "--socket must be a socket id (an integer), got '$socket'"
[[ $mode == physical || $mode == all ]] || die "--mode must be 'physical' or 'all', got '${mode}'"
[[ $interleave == on || $interleave == off ]] || die "--interleave must be 'on' or 'off', got '$interleave'"
(($#)) || die "no command given (usage: $PROG --socket ID --mode physical|all [--interleave on|off] -- COMMAND...)"

CPU_DIR=$SYS/devices/system/cpu
NODE_DIR=$SYS/devices/system/node
[[ -d $CPU_DIR ]] || die "no CPU information in $CPU_DIR (is SYSFS_ROOT right?)"

# --- the socket's CPUs -------------------------------------------------------------------------------

declare -a present=() online=() in_socket=()
declare -A packages=()

for d in "$CPU_DIR"/cpu[0-9]*; do
    [[ -d $d ]] || continue
    n=${d##*/cpu}
    [[ $n =~ ^[0-9]+$ ]] && present[n]=1
done

if read_first_line "$CPU_DIR/online"; then
    expand_list "$LINE" || die "cannot parse $CPU_DIR/online: '$LINE'"
    for c in $LIST; do [[ -n ${present[c]:-} ]] && online[c]=1; done
else
    for c in "${!present[@]}"; do
        read_first_line "$CPU_DIR/cpu$c/online" || LINE=1    # no file: cannot be offlined (cpu0)
        [[ $LINE == 1 ]] && online[c]=1
    done
fi

for c in "${!online[@]}"; do
    read_first_line "$CPU_DIR/cpu$c/topology/physical_package_id" || continue
    pkg=$LINE
    packages[$pkg]=1
    [[ $pkg == "$socket" ]] && in_socket[c]=1
done

if ((${#in_socket[@]} == 0)); then
    ids=()
    for pkg in "${!packages[@]}"; do                     # numeric insertion sort: no sort(1), no /dev/fd
        i=${#ids[@]}
        while ((i > 0)) && ((ids[i - 1] > pkg)); do ids[i]=${ids[i - 1]}; i=$((i - 1)); done
        ids[i]=$pkg
    done
    [[ ${#ids[@]} -gt 0 ]] || die "no CPU in $CPU_DIR has topology/physical_package_id"
    die "socket $socket not found in $SYS (sockets: ${ids[*]})"
fi

# On the live machine, stay inside what this process may use (a container's cpuset, taskset): numactl would
# refuse anything else with a page of usage text. Recorded dumps are taken as they are.
declare -a usable=()
declare -A allowed_cpus=() allowed_mems=()
restricted=0
if [[ $SYS == /sys && -r /proc/self/status ]]; then
    while IFS=$':\t ' read -r key val; do
        case $key in
            Cpus_allowed_list) expand_list "$val"; for c in $LIST; do allowed_cpus[$c]=1; done; restricted=1 ;;
            Mems_allowed_list) expand_list "$val"; for n in $LIST; do allowed_mems[$n]=1; done ;;
        esac
    done </proc/self/status
fi
for c in "${!in_socket[@]}"; do
    if ((!restricted)) || [[ -n ${allowed_cpus[$c]:-} ]]; then usable[c]=1; fi
done
compress "${!in_socket[*]}"
socket_cpus=$RES
((${#usable[@]})) || die "socket $socket: none of its CPUs ($socket_cpus) is allowed for this process" \
    "(Cpus_allowed_list in /proc/self/status)"

declare -a chosen=()
if [[ $mode == all ]]; then
    for c in "${!usable[@]}"; do chosen[c]=1; done
else
    declare -A core_seen=()
    for c in "${!usable[@]}"; do                         # ascending: the first usable thread of a core wins
        read_set "$CPU_DIR/cpu$c/topology" core_cpus_list thread_siblings_list core_cpus thread_siblings \
            || LIST=$c                                   # no sibling information: every CPU is a core
        sib=$LIST
        key=" "
        for s in $sib; do [[ -n ${in_socket[s]:-} ]] && key+="$s "; done
        [[ $key == " " ]] && key=" $c "
        if [[ -z ${core_seen[$key]:-} ]]; then
            core_seen[$key]=1
            chosen[c]=1
        fi
    done
fi

compress "${!chosen[*]}"
cpus=$RES

# --- the socket's memory nodes -----------------------------------------------------------------------

declare -a node_ids=() nodes=()
declare -A with_memory=()
if [[ -d $NODE_DIR ]]; then
    if read_first_line "$NODE_DIR/online"; then
        expand_list "$LINE" || die "cannot parse $NODE_DIR/online: '$LINE'"
        for n in $LIST; do node_ids[n]=1; done
    else
        for d in "$NODE_DIR"/node[0-9]*; do
            [[ -d $d ]] || continue
            n=${d##*/node}
            [[ $n =~ ^[0-9]+$ ]] && node_ids[n]=1
        done
    fi
    if read_first_line "$NODE_DIR/has_memory" || read_first_line "$NODE_DIR/has_normal_memory"; then
        expand_list "$LINE" || die "cannot parse the memory node list in $NODE_DIR: '$LINE'"
        for n in $LIST; do with_memory[$n]=1; done
    else
        for n in "${!node_ids[@]}"; do with_memory[$n]=1; done
    fi
    for n in "${!node_ids[@]}"; do
        [[ -n ${with_memory[$n]:-} ]] || continue
        read_set "$NODE_DIR/node$n" cpulist cpumap || continue
        for c in $LIST; do
            if [[ -n ${in_socket[c]:-} ]]; then nodes[n]=1; break; fi
        done
    done
    ((${#nodes[@]})) || die "socket $socket: none of its CPUs ($socket_cpus) is in an online" \
        "NUMA node with memory in $NODE_DIR"
    if ((${#allowed_mems[@]})); then
        compress "${!nodes[*]}"
        socket_nodes=$RES
        for n in "${!nodes[@]}"; do [[ -n ${allowed_mems[$n]:-} ]] || unset 'nodes[n]'; done
        ((${#nodes[@]})) || die "socket $socket: its NUMA nodes ($socket_nodes) are not allowed for this process" \
            "(Mems_allowed_list in /proc/self/status)"
    fi
else
    nodes[0]=1                                           # kernel without NUMA: everything is node 0
fi
compress "${!nodes[*]}"
mems=$RES

if [[ $interleave == on ]]; then memopt=--interleave=$mems; else memopt=--membind=$mems; fi
argv=("$NUMACTL" "--physcpubind=$cpus" "$memopt" -- "$@")

if ((dry_run)); then
    print_argv "${argv[@]}"
    exit 0
fi

command -v -- "$NUMACTL" >/dev/null 2>&1 || die "numactl not found ('$NUMACTL'): install the numactl package or set NUMACTL"
exec "${argv[@]}"
