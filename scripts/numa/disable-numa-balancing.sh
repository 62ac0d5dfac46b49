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
#      A signal that arrives before the command has started stops the start-up; the value is restored.
#
#   Already 0 (and no other run of this script holds it at 0): changes nothing, just runs the command
#   (exec: this script is replaced by it). No permission to write the file (not root, read-only /proc/sys in a
#   container): says so on stderr and runs the command unchanged. The command's exit status is always returned.
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
#   its wrapper or its command runs (pid + start time from /proc, so a reused pid does not count), so a
#   wrapper killed with SIGKILL does not block the restore forever: the next run, or `--cleanup`, restores.
#   <key> is the balancing file's path with '/' replaced by '_'.
#
# Environment
#   NUMA_BALANCING_FILE       the file to manage (default /proc/sys/kernel/numa_balancing); tests point it at
#                             an ordinary file.
#   NUMA_BALANCING_STATE_DIR  where the lock, saved value and holders live (default /run/orchestrator when
#                             /run is writable, else ${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/orchestrator-$EUID).
#
# Signals from a terminal: Ctrl-C reaches the whole foreground process group, the command included. When this
# script is in the terminal's foreground group it does not forward SIGINT again (llama-server treats a second
# SIGINT as "terminate immediately"). SIGTERM and SIGHUP are always forwarded.
#
# Needs bash >= 4.3, flock (util-linux), mkfifo (coreutils) and Linux /proc (not /dev/fd). Part of orchestrator;
# usable on its own.

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

if [[ -n ${NUMA_BALANCING_STATE_DIR:-} ]]; then
    STATE_DIR=$NUMA_BALANCING_STATE_DIR
elif [[ -d /run && -w /run ]]; then
    STATE_DIR=/run/orchestrator
else
    STATE_DIR=${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/orchestrator-$EUID
fi
KEY=${BALANCING_FILE//\//_}
LOCK_FILE=$STATE_DIR/$KEY.lock
SAVED_FILE=$STATE_DIR/$KEY.saved
HOLDERS_DIR=$STATE_DIR/$KEY.holders
ERR_FILE=$STATE_DIR/$KEY.err              # the last failed write's message (written under the lock)

LOCK_FD=
HOLDER_FILE=                              # set once this run may have registered (release removes it)
CHILD=                                    # the command's pid
READY=0                                   # the command's process can receive signals (see run)
SIGNALLED=0
PENDING=                                  # a signal that came before the command could take it

# --- state helpers. They set variables instead of printing, so deciding needs no subshell: a subshell in
# --- our process group would die from a terminal's Ctrl-C and its silence would read as an answer.

VALUE='' WHY='' REPLY='' LIVE=0

read_value() {  # VALUE=first line of the balancing file; fails if unreadable
    VALUE=""
    { IFS= read -r VALUE <"$BALANCING_FILE"; } 2>/dev/null || [[ -n $VALUE ]]
}

write_value() {  # write_value V; on failure WHY=the reason (Permission denied, Read-only file system, ...)
    WHY=""
    if [[ -d $STATE_DIR ]]; then
        if { printf '%s\n' "$1" >"$BALANCING_FILE"; } 2>"$ERR_FILE"; then return 0; fi
        { IFS= read -r WHY <"$ERR_FILE"; } 2>/dev/null || true
        WHY=${WHY##*: }
    else
        if { printf '%s\n' "$1" >"$BALANCING_FILE"; } 2>/dev/null; then return 0; fi
    fi
    WHY=${WHY:-write failed}
    return 1
}

starttime() {  # REPLY=start time of PID (field 22 of /proc/PID/stat); fails if PID is gone or a zombie
    local stat rest
    local -a f
    REPLY=""
    { IFS= read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
    rest=${stat##*) }                      # the command name may hold spaces and parentheses
    read -r -a f <<<"$rest"
    [[ ${f[0]} != Z && ${f[0]} != X ]] || return 1
    REPLY=${f[19]}
}

alive() {  # alive PID STARTTIME
    starttime "$1" && [[ $REPLY == "$2" ]]
}

lock() {  # idempotent; LOCK_FD is set only once the lock is held (an interrupted lock leaves nothing held)
    local fd
    [[ -z $LOCK_FD ]] || return 0
    command -v flock >/dev/null 2>&1 || die "flock (util-linux) is required to share the setting between runs"
    [[ -d $HOLDERS_DIR ]] || mkdir -p -- "$HOLDERS_DIR"
    exec {fd}>>"$LOCK_FILE"
    if ! flock -x "$fd"; then
        exec {fd}>&-
        return 1
    fi
    LOCK_FD=$fd
}

unlock() {
    if [[ -n $LOCK_FD ]]; then
        exec {LOCK_FD}>&-                  # closing the only descriptor releases the flock
        LOCK_FD=
    fi
}

prune_holders() {  # with the lock: remove holder files none of whose processes lives; LIVE=live holders
    local f pid st live
    LIVE=0
    for f in "$HOLDERS_DIR"/*; do
        [[ -f $f ]] || continue
        live=0
        while read -r pid st; do
            [[ -n ${pid:-} && -n ${st:-} ]] || continue
            if alive "$pid" "$st"; then live=1; break; fi
        done <"$f"
        if ((live)); then LIVE=$((LIVE + 1)); else rm -f -- "$f"; fi
    done
}

restore_saved() {  # with the lock and no live holder: put back the value the first holder found
    local saved=""
    [[ -f $SAVED_FILE ]] || return 0
    { IFS= read -r saved <"$SAVED_FILE"; } 2>/dev/null || true
    if [[ $saved =~ ^[0-9]+$ ]]; then
        if ! write_value "$saved"; then
            say "could not restore $BALANCING_FILE to $saved: $WHY"
            return 1
        fi
    fi
    rm -f -- "$SAVED_FILE"
}

register_holder() {  # register_holder PID...: (re)write this run's holder file atomically (with the lock)
    local tmp=$HOLDERS_DIR/.$$.tmp p lines=""
    for p in "$@"; do
        if starttime "$p"; then lines+="$p $REPLY"$'\n'; fi
    done
    printf '%s' "$lines" >"$tmp"
    mv -f -- "$tmp" "$HOLDERS_DIR/$$"
}

# shellcheck disable=SC2329  # called from the EXIT trap
on_exit() {
    local rc=$?
    set +e
    if [[ -n $HOLDER_FILE ]]; then
        if lock; then
            rm -f -- "$HOLDER_FILE" "$HOLDERS_DIR/.$$.tmp"
            prune_holders
            if ((LIVE == 0)); then restore_saved; fi
            unlock
        fi
    fi
    if [[ -z $CHILD && -n $PENDING ]]; then rc=$((128 + $(signal_number "$PENDING"))); fi
    exit "$rc"
}

# --- signals -----------------------------------------------------------------------------------------

signal_number() { case $1 in HUP) echo 1 ;; INT) echo 2 ;; TERM) echo 15 ;; *) echo 0 ;; esac; }

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
    if ((!READY)); then
        PENDING=$1        # the command cannot take it yet: it gets it as soon as it can (or never starts)
        return 0
    fi
    if [[ $1 == INT ]] && in_terminal_foreground; then
        return 0          # the terminal already sent SIGINT to the command (same process group)
    fi
    kill -s "$1" "$CHILD" 2>/dev/null || true
}

# --- commands ----------------------------------------------------------------------------------------

status() {
    local saved=""
    read_value || die "cannot read $BALANCING_FILE"
    LIVE=0
    if [[ -d $HOLDERS_DIR ]]; then
        lock
        prune_holders
        [[ -f $SAVED_FILE ]] && IFS= read -r saved <"$SAVED_FILE"
        unlock
    fi
    printf 'file=%s value=%s saved=%s holders=%s state_dir=%s\n' "$BALANCING_FILE" "$VALUE" "${saved:--}" \
        "$LIVE" "$STATE_DIR"
}

cleanup() {
    if [[ -d $HOLDERS_DIR ]]; then
        lock
        prune_holders
        if ((LIVE == 0)); then restore_saved || { unlock; exit 1; }; fi
        unlock
    fi
    status
}

exec_unchanged() {  # become the command (nothing to restore)
    trap - EXIT
    unlock
    if [[ -n $PENDING ]]; then exit $((128 + $(signal_number "$PENDING"))); fi
    exec "$@"
}

run() {
    local v rc sync sync_fifo

    trap 'forward TERM' TERM
    trap 'forward HUP' HUP
    trap 'forward INT' INT

    if ! read_value; then
        say "cannot read $BALANCING_FILE: running the command with NUMA balancing unchanged"
        exec_unchanged "$@"
    fi
    v=$VALUE
    if [[ ! $v =~ ^[0-9]+$ ]]; then
        say "unexpected content '$v' in $BALANCING_FILE: running the command with NUMA balancing unchanged"
        exec_unchanged "$@"
    fi
    if ! { [[ -d $HOLDERS_DIR ]] || mkdir -p -- "$HOLDERS_DIR"; } 2>/dev/null || [[ ! -w $HOLDERS_DIR ]]; then
        [[ $v == 0 ]] || say "cannot use state directory $STATE_DIR: running the command with NUMA balancing" \
            "unchanged ($v)"
        exec_unchanged "$@"
    fi

    HOLDER_FILE=$HOLDERS_DIR/$$             # from here on, leaving in any way goes through on_exit
    trap on_exit EXIT
    lock
    prune_holders
    if ((LIVE == 0)); then
        # Nobody else holds it: a value saved by holders that were all killed is the real original.
        if [[ -f $SAVED_FILE ]]; then
            restore_saved || true
            read_value && [[ $VALUE =~ ^[0-9]+$ ]] && v=$VALUE
        fi
        if [[ $v == 0 ]]; then
            exec_unchanged "$@"              # already off: change nothing
        fi
        printf '%s\n' "$v" >"$SAVED_FILE.tmp.$$"
        mv -f -- "$SAVED_FILE.tmp.$$" "$SAVED_FILE"
        if ! write_value 0; then
            [[ -z $PENDING ]] || exit 1      # interrupted while writing: on_exit restores
            rm -f -- "$SAVED_FILE"
            say "cannot write $BALANCING_FILE ($WHY): running the command with NUMA balancing unchanged ($v)"
            exec_unchanged "$@"
        fi
    elif [[ $v != 0 ]]; then
        # Others hold it off but someone switched it back on: switch it off again, keep the saved original.
        write_value 0 || say "cannot write $BALANCING_FILE ($WHY): NUMA balancing stays at $v"
    fi
    register_holder "$$"
    unlock
    [[ -z $PENDING ]] || exit 1              # stopped during start-up: on_exit restores

    # The command's process registers itself before it becomes the command (no moment when it runs
    # unregistered), and only then may it be signalled: a background job of a non-interactive shell starts
    # with SIGINT ignored, and a SIGINT sent before `trap - INT` would be lost. It says "ready" on a pipe: a
    # FIFO opened read-write (so opening never blocks) and unlinked at once, not a process substitution,
    # which needs /dev/fd (absent on a minimal root: an initramfs, a bare container).
    sync_fifo=$HOLDERS_DIR/.$$.ready
    rm -f -- "$sync_fifo"
    mkfifo -m 600 -- "$sync_fifo"
    exec {sync}<>"$sync_fifo"
    rm -f -- "$sync_fifo"
    (
        trap - INT QUIT TERM HUP EXIT
        lock
        register_holder "$$" "$BASHPID"
        unlock
        printf 'r\n' >&"$sync"
        exec {sync}>&-
        exec "$@"
    ) &
    CHILD=$!
    while :; do
        if IFS= read -r -t 0.2 -u "$sync" _; then break; fi
        # a signal trapped during `read` can swallow the line: the registration (written before it) also says
        # the command's process has reset its traps and may be signalled
        grep -q "^$CHILD " "$HOLDER_FILE" 2>/dev/null && break
        kill -0 "$CHILD" 2>/dev/null || break   # died before it was ready
    done
    exec {sync}>&-
    READY=1
    if [[ -n $PENDING ]]; then kill -s "$PENDING" "$CHILD" 2>/dev/null || true; fi

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
