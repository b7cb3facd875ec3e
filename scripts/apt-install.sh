#!/usr/bin/env bash
# Install Debian packages for scripts/setup.sh without ever hanging it silently: apt's own lines
# stream to stderr (prefixed "  apt: "), with its download and install percentages; a dpkg lock
# held by another process is waited on for LOCK_S seconds, an unreachable mirror for NET_S per
# connection, and apt that says nothing for STALL_S seconds is stopped. Each case is said in one
# line and the packages are skipped (exit 1), never waited on for minutes.
# Usage: bash scripts/apt-install.sh WHAT PACKAGE...   (as root; WHAT says what they are for)
set -uo pipefail
LOCK_S=${APT_LOCK_S:-10}
NET_S=${APT_NET_S:-10}
STALL_S=${APT_STALL_S:-60}
what=$1
shift
start=$SECONDS
log=$(mktemp)
trap 'rm -f "$log"' EXIT

say() { printf 'setup: %s\n' "$*" >&2; }

# apt_get ARGS...: apt-get ARGS, its lines streamed; 124 when it stalled and was stopped
apt_get() {
  local line pid rc shown=-10
  coproc APT { DEBIAN_FRONTEND=noninteractive exec apt-get -q -y -o APT::Status-Fd=1 \
    -o DPkg::Lock::Timeout="$LOCK_S" -o Acquire::Retries=0 \
    -o Acquire::http::Timeout="$NET_S" -o Acquire::https::Timeout="$NET_S" \
    -o Acquire::ftp::Timeout="$NET_S" "$@" 2>&1; }
  pid=$APT_PID
  exec {out}<&"${APT[0]}"
  while :; do
    IFS= read -r -t "$STALL_S" line <&"$out"
    rc=$?
    if [ "$rc" -gt 128 ]; then  # silent for STALL_S seconds
      kill "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      exec {out}<&-
      return 124
    fi
    [ "$rc" -ne 0 ] && [ -z "$line" ] && break  # end of its output
    printf '%s\n' "$line" >>"$log"
    case $line in
      dlstatus:*|pmstatus:*)  # "pmstatus:PKG:PERCENT:DESCRIPTION": a line per 10%
        IFS=: read -r kind _ percent desc <<<"$line"
        percent=${percent%%.*}
        if [ "$percent" -ge $((shown + 10)) ] || [ "$percent" -lt "$shown" ]; then
          shown=$percent
          printf '  apt: %s %s%% %s (%s s)\n' "${kind%status}" "$percent" "$desc" \
            $((SECONDS - start)) >&2
        fi ;;
      *) [ -n "$line" ] && printf '  apt: %s\n' "$line" >&2 ;;
    esac
  done
  exec {out}<&-
  wait "$pid"
}

# why_not RC: the one line that says why apt failed, or nothing
why_not() {
  if [ "$1" -eq 124 ]; then
    echo "apt-get printed nothing for ${STALL_S} s (a hung mirror or package script), so it was stopped"
  elif holder=$(grep -o 'process [0-9]* ([^)]*)' "$log" | head -1) && [ -n "$holder" ]; then
    echo "another package manager holds the dpkg lock ($holder; waited ${LOCK_S} s)"
  elif grep -qE "Could not (resolve|connect)|Temporary failure resolving|Connection timed out|Network is unreachable" "$log"; then
    echo "the package mirror cannot be reached (gave up after ${NET_S} s per connection)"
  fi
}

say "installing $* with apt-get ($what)"
apt_get install --no-install-recommends "$@"
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ -z "$(why_not "$rc")" ]; then
  say "refreshing apt's package lists, then installing again ($((SECONDS - start)) s so far)"
  : >"$log"
  apt_get update && apt_get install --no-install-recommends "$@"
  rc=$?
fi
if [ "$rc" -eq 0 ]; then
  say "installed $* in $((SECONDS - start)) s"
  exit 0
fi
reason=$(why_not "$rc")
say "skipped $* after $((SECONDS - start)) s: ${reason:-apt-get failed (exit $rc, its lines above)}"
exit 1
