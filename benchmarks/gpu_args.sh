# Sourced by the lent-GPU scripts (gpu_check.sh, gpu_study.sh): their common arguments,
# `[--dry-run] OUT`. The script defines usage() first. Sets dry_run (0 or 1), out (made
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
