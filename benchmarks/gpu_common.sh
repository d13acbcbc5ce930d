# Sourced by the lent-GPU scripts (gpu_check.sh, gpu_study.sh): their common arguments,
# `[--dry-run] OUT`, and run_stage, which runs one of their stages. The script defines usage() first. Sets dry_run (0 or 1), out (made
# absolute: the stages run from the repository's root) and python (PYTHON, default
# python3), and moves to the repository's root.
dry_run=0
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "$0: unknown option $1" >&2; usage; exit 2 ;;
        *)
            if [ -n "$out" ]; then echo "$0: one OUT folder, got '$out' and '$1'" >&2; exit 2; fi
            out="$1" ;;
    esac
    shift
done
if [ -z "$out" ]; then
    echo "$0: OUT is required" >&2
    usage
    exit 2
fi
out=$(realpath -m "$out")
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

# run_stage NAME LIMIT_S KILL_AFTER_S COMMAND LOG: run COMMAND under a time limit, its
# output appended to LOG, its start and exit status printed and logged; returns its status
run_stage() {
    local started code
    started=$(date +%s)
    echo "[$1] $4" | tee -a "$5"
    set +e
    timeout --kill-after="$3" "$2" bash -c "$4" >> "$5" 2>&1
    code=$?
    set -e
    echo "[$1] exit $code after $(( $(date +%s) - started ))s" | tee -a "$5"
    return "$code"
}
