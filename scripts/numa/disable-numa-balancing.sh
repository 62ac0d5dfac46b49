#!/usr/bin/env bash
# disable-numa-balancing.sh — run a command with automatic NUMA balancing switched off, then put it back.
#
# Usage:
#   disable-numa-balancing.sh [--] COMMAND [ARG...]
#   disable-numa-balancing.sh --status      # print the value, the saved original and the live holders
#   disable-numa-balancing.sh --cleanup     # forget holders that died (kill -9) and restore if none is left
#   disable-numa-balancing.sh --help
#
# What it does
#   1. Reads /proc/sys/kernel/numa_balancing (0 = off; 1, 2, 3 = on in some mode) and, when it is not 0,
#      records it and writes 0.
#   2. Runs COMMAND as a child, forwarding SIGTERM, SIGHUP and SIGINT to it, waits for it and exits with its
#      status (128+N when it was killed by signal N).
#   3. Restores the recorded value when the command ends: normal exit, failure, SIGINT, SIGTERM, SIGHUP.
#
#   Already 0 (and no other run of this script holds it at 0): changes nothing, just runs the command.
#   No permission to write the file (not root, read-only /proc/sys in a container): says so on stderr and
#   runs the command unchanged. The command's own exit status is always returned.
#
# Several runs at once (several workers on one machine)
#   The setting is machine-wide, so it must come back only when the LAST run ends. Each run registers as a
#   "holder" in a state directory, under an flock(1) lock:
#       $STATE_DIR/<key>.lock       the lock file (flock -x around every read-modify-write of the state)
#       $STATE_DIR/<key>.saved      the value found before the first holder set 0
#       $STATE_DIR/<key>.holders/P  one file per running wrapper (pid P): "pid starttime" lines for the
#                                   wrapper and its command
#   The first holder saves the value and writes 0; later ones only register; each one leaving removes its file
#   and, if no live holder is left, writes the saved value back and deletes it. A holder counts as live while
#   its wrapper or its command is running (pid + start time from /proc, so a reused pid does not count), so a
#   wrapper killed with SIGKILL does not block the restore forever: the next run, or `--cleanup`, restores.
#   <key> is the balancing file's path with '/' replaced by '_'.
#
# Environment
#   NUMA_BALANCING_FILE       the file to manage (default /proc/sys/kernel/numa_balancing); tests point it at
#                             an ordinary file.
#   NUMA_BALANCING_STATE_DIR  where the lock, saved value and holders live (default /run/orchestrator when
#                             /run is writable, else ${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/orchestrator-$UID).
#
# Signals from a terminal: Ctrl-C reaches the whole foreground process group, the command included. When this
# script is in the terminal's foreground group it does not forward SIGINT again (llama-server treats a second
# SIGINT as "terminate immediately"). SIGTERM and SIGHUP are always forwarded.
#
# Needs bash >= 4.3 and flock (util-linux). Part of orchestrator; usable on its own.

set -euo pipefail

PROG=${0##*/}
BALANCING_FILE=${NUMA_BALANCING_FILE:-/proc/sys/kernel/numa_balancing}

usage() {
    local line
    while IFS= read -r line; do
        [[ $line == '#!'* ]] && continue
        [[ $line == '#'* ]] || break
        line=${line#\#}
        printf '%s\n' "${line# }"
    done <"$0"
}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { say "$*"; exit 2; }

default_state_dir() {
    if [[ -d /run && -w /run ]]; then
        printf '/run/orchestrator'
    else
        printf '%s/orchestrator-%s' "${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}" "$(id -u)"
    fi
}

STATE_DIR=${NUMA_BALANCING_STATE_DIR:-$(default_state_dir)}
KEY=${BALANCING_FILE//\//_}
LOCK_FILE=$STATE_DIR/$KEY.lock
SAVED_FILE=$STATE_DIR/$KEY.saved
HOLDERS_DIR=$STATE_DIR/$KEY.holders

LOCK_FD=
HOLDER_FILE=
CHILD=
SIGNALLED=0
PENDING=

# --- small helpers -------------------------------------------------------------------------------------

read_value() {  # prints the file's first line; fails if unreadable
    local v=""
    { IFS= read -r v <"$BALANCING_FILE"; } 2>/dev/null || [[ -n $v ]] || return 1
    printf '%s' "$v"
}

write_value() {  # write_value VALUE: prints the reason on stdout when it fails
    local err
    if err=$( { printf '%s\n' "$1" >"$BALANCING_FILE"; } 2>&1 ); then
        return 0
    fi
    printf '%s' "${err##*: }"
    return 1
}

starttime() {  # starttime PID: the process start time (field 22 of /proc/PID/stat), fails if PID is gone
    local stat rest
    local -a f
    { IFS= read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
    rest=${stat##*) }                      # the command name may hold spaces and parentheses
    read -r -a f <<<"$rest"
    printf '%s' "${f[19]}"
}

alive() {  # alive PID STARTTIME
    local now
    now=$(starttime "$1") || return 1
    [[ $now == "$2" ]]
}

lock() {
    command -v flock >/dev/null 2>&1 || die "flock (util-linux) is required to share the setting between runs"
    mkdir -p -- "$HOLDERS_DIR"
    exec {LOCK_FD}>>"$LOCK_FILE"
    flock -x "$LOCK_FD"
}

unlock() {
    if [[ -n $LOCK_FD ]]; then
        flock -u "$LOCK_FD" || true
        exec {LOCK_FD}>&-
        LOCK_FD=
    fi
}

# Remove holder files none of whose processes is alive; prints the number of live holders.
prune_holders() {
    local f pid st live n=0
    for f in "$HOLDERS_DIR"/*; do
        [[ -f $f ]] || continue
        live=0
        while read -r pid st; do
            [[ -n ${pid:-} && -n ${st:-} ]] || continue
            if alive "$pid" "$st"; then live=1; break; fi
        done <"$f"
        if ((live)); then n=$((n + 1)); else rm -f -- "$f"; fi
    done
    printf '%d' "$n"
}

# With the lock held and no live holder: put back a value saved by holders that are all gone.
restore_saved() {
    local saved why
    [[ -f $SAVED_FILE ]] || return 0
    IFS= read -r saved <"$SAVED_FILE" || true
    if [[ $saved =~ ^[0-9]+$ ]]; then
        if why=$(write_value "$saved"); then
            rm -f -- "$SAVED_FILE"
            return 0
        fi
        say "could not restore $BALANCING_FILE to $saved: $why"
        return 1
    fi
    rm -f -- "$SAVED_FILE"
}

register_holder() {  # register_holder PID...: (re)write this wrapper's holder file atomically
    local tmp p st
    tmp=$HOLDERS_DIR/.$$.tmp
    : >"$tmp"
    for p in "$@"; do
        st=$(starttime "$p") || continue
        printf '%s %s\n' "$p" "$st" >>"$tmp"
    done
    mv -f -- "$tmp" "$HOLDERS_DIR/$$"
    HOLDER_FILE=$HOLDERS_DIR/$$
}

# shellcheck disable=SC2329  # called from the EXIT trap
release() {
    [[ -n $HOLDER_FILE ]] || return 0
    lock
    rm -f -- "$HOLDER_FILE"
    HOLDER_FILE=
    if [[ $(prune_holders) == 0 ]]; then
        restore_saved || true
    fi
    unlock
}

# --- signals -----------------------------------------------------------------------------------------

# shellcheck disable=SC2329  # called from forward (a trap)
in_terminal_foreground() {  # our process group is the controlling terminal's foreground group
    local stat rest
    local -a f
    { IFS= read -r stat <"/proc/$$/stat"; } 2>/dev/null || return 1
    rest=${stat##*) }
    read -r -a f <<<"$rest"
    # fields after the command: state ppid pgrp session tty_nr tpgid
    [[ ${f[5]} -gt 0 && ${f[5]} == "${f[2]}" ]]
}

# shellcheck disable=SC2329  # called from the signal traps
forward() {
    SIGNALLED=1
    if [[ -z $CHILD ]]; then
        PENDING=$1        # the command has not started yet: it will get this signal as soon as it does
        return 0
    fi
    if [[ $1 == INT ]] && in_terminal_foreground; then
        return 0          # the terminal already sent SIGINT to the command (same process group)
    fi
    kill -s "$1" "$CHILD" 2>/dev/null || true
}

# --- commands ----------------------------------------------------------------------------------------

status() {
    local v saved="" n
    v=$(read_value) || die "cannot read $BALANCING_FILE"
    if [[ -d $HOLDERS_DIR ]]; then
        lock
        n=$(prune_holders)
        [[ -f $SAVED_FILE ]] && IFS= read -r saved <"$SAVED_FILE"
        unlock
    else
        n=0
    fi
    printf 'file=%s value=%s saved=%s holders=%s state_dir=%s\n' "$BALANCING_FILE" "$v" "${saved:--}" "$n" "$STATE_DIR"
}

cleanup() {
    [[ -d $HOLDERS_DIR ]] || { status; return 0; }
    lock
    if [[ $(prune_holders) == 0 ]]; then
        restore_saved || { unlock; exit 1; }
    fi
    unlock
    status
}

signal_number() { case $1 in HUP) echo 1 ;; INT) echo 2 ;; TERM) echo 15 ;; esac; }

exec_unchanged() {  # run the command in place of this script (nothing to restore)
    trap - EXIT
    if [[ -n $PENDING ]]; then exit $((128 + $(signal_number "$PENDING"))); fi
    exec "$@"
}

run() {
    local v n why rc

    trap 'forward TERM' TERM
    trap 'forward HUP' HUP
    trap 'forward INT' INT

    if ! v=$(read_value); then
        say "cannot read $BALANCING_FILE: running the command with NUMA balancing unchanged"
        exec_unchanged "$@"
    fi
    if [[ ! $v =~ ^[0-9]+$ ]]; then
        say "unexpected content '$v' in $BALANCING_FILE: running the command with NUMA balancing unchanged"
        exec_unchanged "$@"
    fi

    if ! { mkdir -p -- "$HOLDERS_DIR" && [[ -w $HOLDERS_DIR ]]; } 2>/dev/null; then
        if [[ $v == 0 ]]; then exec_unchanged "$@"; fi
        say "cannot use state directory $STATE_DIR: running the command with NUMA balancing unchanged ($v)"
        exec_unchanged "$@"
    fi

    lock
    n=$(prune_holders)
    if [[ $n == 0 ]]; then
        # Nobody else holds it: a value saved by holders that were all killed is the real original.
        if [[ -f $SAVED_FILE ]]; then
            restore_saved || true
            v=$(read_value) || v=0
        fi
        if [[ $v == 0 ]]; then
            unlock
            exec_unchanged "$@"                        # already off: change nothing
        fi
        printf '%s\n' "$v" >"$SAVED_FILE.tmp.$$"
        mv -f -- "$SAVED_FILE.tmp.$$" "$SAVED_FILE"
        if ! why=$(write_value 0); then
            rm -f -- "$SAVED_FILE"
            unlock
            say "cannot write $BALANCING_FILE ($why): running the command with NUMA balancing unchanged ($v)"
            exec_unchanged "$@"
        fi
    elif [[ $v != 0 ]]; then
        # Others hold it off but someone switched it back on: switch it off again, keep the saved original.
        write_value 0 >/dev/null || say "cannot write $BALANCING_FILE: NUMA balancing stays at $v"
    fi
    trap release EXIT
    register_holder "$$"
    unlock

    # A background job of a non-interactive shell starts with SIGINT/SIGQUIT ignored: give them back.
    ( trap - INT QUIT; exec "$@" ) &
    CHILD=$!
    if [[ -n $PENDING ]]; then kill -s "$PENDING" "$CHILD" 2>/dev/null || true; fi
    lock
    register_holder "$$" "$CHILD"
    unlock

    while :; do
        SIGNALLED=0
        rc=0
        wait "$CHILD" || rc=$?
        if ((SIGNALLED)) && kill -0 "$CHILD" 2>/dev/null; then
            continue                         # interrupted by a forwarded signal; the command still runs
        fi
        break
    done
    if ((SIGNALLED)); then
        rc=0
        wait "$CHILD" 2>/dev/null || rc=$?   # the command's own status (bash keeps it after reaping)
    fi
    exit "$rc"
}

case ${1:-} in
    -h | --help) usage; exit 0 ;;
    --status) status; exit 0 ;;
    --cleanup) cleanup; exit 0 ;;
    --) shift ;;
    -*) die "unknown option '$1' (try --help)" ;;
esac
[[ $# -gt 0 ]] || die "no command given (usage: $PROG [--] COMMAND [ARG...]; try --help)"
run "$@"
