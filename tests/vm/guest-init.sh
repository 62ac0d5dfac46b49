#!/bin/bash
# guest-init.sh — PID 1 of the two-node test guest (tests/vm/numa_guest.py boots it): the host's own bash, run
# from the host's root as the guest sees it (virtiofs under a tmpfs overlay).
#
# It mounts what a command expects (/run, /dev/pts, /dev/shm), brings up the loopback interface, runs the
# command numa_guest.py left in the job folder (orch.job= on the kernel command line: argv, env and cwd as
# NUL-separated lists) with the console as its stdout and stderr, prints "<orch.token> exit=N" and reboots,
# which ends QEMU (-no-reboot). /dev/fd is left out unless asked for (orch.devfd=1), as on a minimal root: the
# NUMA wrappers must not need it.

set -u
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH HOME=/root LANG=C.UTF-8       # HOME: a default; the job's env (the host's HOME) replaces it

arg() {  # the value of a key=value word of the kernel command line
    local w
    for w in $(</proc/cmdline); do [[ $w == "$1="* ]] && { printf '%s' "${w#*=}"; return 0; }; done
    return 1
}

job=$(arg orch.job)
token=$(arg orch.token)

mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ip link set lo up 2>/dev/null || true
if [[ $(arg orch.devfd) == 1 ]]; then         # numa_guest.py --dev-fd: the links a udev-managed /dev has
    ln -sfn /proc/self/fd /dev/fd
    ln -sfn /proc/self/fd/0 /dev/stdin
    ln -sfn /proc/self/fd/1 /dev/stdout
    ln -sfn /proc/self/fd/2 /dev/stderr
fi
hostname numa-guest 2>/dev/null || true

rc=2
if [[ -n $job && -r $job/argv ]]; then
    mapfile -d '' -t argv <"$job/argv"
    while IFS= read -r -d '' kv; do export "$kv"; done <"$job/env"
    cwd=$(<"$job/cwd")
    cd "$cwd" 2>/dev/null || cd /
    printf '%s started\n' "$token"           # the host: booted; the command runs from here on
    "${argv[@]}" </dev/null
    rc=$?
else
    echo "guest-init: no job folder in the kernel command line" >&2
fi
printf '\n%s exit=%d\n' "$token" "$rc"
sync
echo b >/proc/sysrq-trigger
sleep 10
