# Sourced by the launchers with on/off variables (examples/qwen2_5_1_5b_math_mentor.sh: EXACT,
# _guide_failing.sh: PREFIX). `flag_on NAME WHAT`: true when $NAME is 1, false when it is 0 or
# unset; any other value (EXACT=yes) stops the launcher before python starts, with one line
# naming it and what 0 and 1 do (WHAT), exit 2.
flag_on() {
    local name=$1 what=$2 value=${!1:-0}
    case $value in
        0) return 1 ;;
        1) return 0 ;;
    esac
    echo "error: $name=$value is not valid; expected $what" >&2
    exit 2
}
