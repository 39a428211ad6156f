#!/bin/sh
# kvvm-agent: runs shell commands for the host over the second serial port.
#
# stdin/stdout are /dev/ttyS1, switched to raw mode so that no byte is echoed
# or translated. One request per line:
#   KVX-RUN <id> <timeout-seconds> <base64 of the command text>
# One answer per request, stdout and stderr base64-encoded so that any byte
# survives and no output can be mistaken for a marker:
#   KVX-BEGIN <id>
#   <base64 of stdout, in lines>
#   KVX-STDERR <id>
#   <base64 of stderr, in lines>
#   KVX-END <id> <exit status>
# The command runs under `sh` with stdin from /dev/null and is killed after
# its timeout (exit status 137).

stty raw -echo 2>/dev/null
D=/run/kvvm/agent
mkdir -p "$D"
cd / || exit 1
set -f
echo "KVX-HELLO"
while IFS= read -r line; do
    # shellcheck disable=SC2086 # split the request into its words
    set -- $line
    if [ "$1" != KVX-RUN ] || [ $# -ne 4 ]; then
        echo "KVX-BAD request ignored"
        continue
    fi
    id=$2
    secs=$3
    if ! printf '%s\n' "$4" | base64 -d > "$D/cmd" 2>/dev/null; then
        echo "KVX-BEGIN $id"
        echo "KVX-STDERR $id"
        echo "a3Z2bS1hZ2VudDogYmFkIGJhc2U2NAo="
        echo "KVX-END $id 254"
        continue
    fi
    timeout -s KILL "$secs" sh "$D/cmd" </dev/null >"$D/out" 2>"$D/err"
    rc=$?
    echo "KVX-BEGIN $id"
    base64 "$D/out"
    echo "KVX-STDERR $id"
    base64 "$D/err"
    echo "KVX-END $id $rc"
done
