# The example scripts' console policy, sourced by examples/grpo/*.sh (bash only; not run on its own).
#
# By default the terminal gets a short header (what runs, where the results and the log go), the lines
# a command marks as progress (one per training step), failures and the closing summary. Everything
# else -- the shell trace, Ray's worker warnings, verl's per-step metric dumps, library banners -- goes
# to one log file. VERBOSE=1 prints everything on the terminal as well (and traces the script).
#
#   source "${SCRIPT_DIR}/../common/console.sh"
#   console_init "${RUN_DIR}/run.log"          # the log file (emptied unless RESUME=true); VERBOSE=1: `set -x`
#   console_header "title" "line" ...          # the run's header: a rule, the lines, a rule
#   console_say "text"                         # always on the terminal (and in the log)
#   console_run 'REGEX' cmd args...            # cmd's output -> log; lines matching REGEX -> terminal
#
# A failing command prints its last lines, the error's own message line(s) found anywhere in its output
# (a traceback's last line; the tail may not reach it) and the log path, then the script exits with its status.
# Ray prefixes a worker's lines with "(Actor pid=N)" and colours it; the terminal copy drops both.

VERBOSE="${VERBOSE:-0}"
CONSOLE_LOG=""
# Lines shown from a failing command's output.
CONSOLE_TAIL_LINES="${CONSOLE_TAIL_LINES:-40}"

console_init() {
    CONSOLE_LOG="$1"
    mkdir -p "$(dirname "${CONSOLE_LOG}")"
    if [ "${RESUME:-false}" != true ]; then : > "${CONSOLE_LOG}"; fi  # a resumed run appends to its log
    if [ "${VERBOSE}" = 1 ]; then
        set -x
    else
        # the shell trace goes to the log, not the terminal
        exec {CONSOLE_TRACE_FD}>>"${CONSOLE_LOG}"
        BASH_XTRACEFD="${CONSOLE_TRACE_FD}"
        set -x
    fi
}

console_say() {
    printf '%s\n' "$*" | tee -a "${CONSOLE_LOG:-/dev/null}"
}

console_header() {
    local rule="================================================================================" line
    console_say "${rule}"
    for line in "$@"; do console_say "${line}"; done
    console_say "${rule}"
}

# The terminal copy of a line: no colour codes, no "(Actor pid=N) " prefix.
_console_clean() {
    sed -u -E -e 's/\x1b\[[0-9;]*m//g' -e 's/^\([^)]*pid=[0-9]+[^)]*\) //'
}

# A line equal to the one shown just before it is not shown again. A shell loop, not awk: mawk reads its
# input in blocks, so the progress lines would only appear at the end of the run.
_console_once() {
    { set +x; } 2>/dev/null
    local line last=""
    while IFS= read -r line; do
        if [ "${line}" != "${last}" ]; then printf '%s\n' "${line}"; fi
        last="${line}"
    done
}

console_run() {
    local show="$1"
    shift
    local errexit=false
    case "$-" in *e*) errexit=true ;; esac
    set +e
    # The readers ignore SIGINT/SIGTERM: on Ctrl-C the command cleans up (destroys its remote jobs)
    # while still writing to them; a reader killed first would break its pipe mid-clean-up.
    if [ "${VERBOSE}" = 1 ]; then
        { "$@" 2>&1; } | (trap '' INT TERM; exec tee -a "${CONSOLE_LOG}")
    else
        { "$@" 2>&1; } | (trap '' INT TERM; exec tee -a "${CONSOLE_LOG}") \
            | (trap '' INT TERM; _console_clean | grep --line-buffered -E -- "${show}" | _console_once)
    fi
    local rc="${PIPESTATUS[0]}"
    if [ "${errexit}" = true ]; then set -e; fi
    if [ "${rc}" != 0 ]; then
        if [ "${VERBOSE}" != 1 ]; then
            echo "---- last ${CONSOLE_TAIL_LINES} lines of ${CONSOLE_LOG} ----" >&2
            grep -v -E '^\++ ' "${CONSOLE_LOG}" | tail -n "${CONSOLE_TAIL_LINES}" | _console_clean >&2  # no trace lines
        fi
        _console_error_lines >&2
        echo "FAILED (exit status ${rc}): ${*:1:3} ... -- full log: ${CONSOLE_LOG}" >&2
        exit "${rc}"
    fi
}

# The error's own message, wherever it is in the log: Python's `pkg.SomeError: message` lines (the last
# of a traceback, and Ray's copy of a worker's; Hydra's with HYDRA_FULL_ERROR=1), the entry point's
# `[remote_backend] error:` line -- the last few distinct ones, in order, after the tail (which may not reach them).
_console_error_lines() {
    { set +x; } 2>/dev/null
    local pattern='^([A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*(Error|Exception)(\([A-Za-z0-9_.]*\))?: |^\[remote_backend\] error: '
    local lines
    lines="$(grep -v -E '^\++ ' "${CONSOLE_LOG}" | _console_clean | grep -E -- "${pattern}" | awk '!seen[$0]++' | tail -n 3 || true)"
    if [ -n "${lines}" ]; then
        echo "---- error ----"
        printf '%s\n' "${lines}"
    fi
    return 0
}
