#!/bin/bash
# Shrinks what a `device` call sends (tracked and untracked-not-ignored files, 64 MiB in all with
# the carried paths) to what the device-side scripts read, so that pack.sh's parts can be 62M:
# the committed checkpoints alone are 54 MB.
#   scripts/device/slim.sh on    untrack everything in the index but scripts/device/ and the
#                                golden fixture, and ignore the rest (.git/info/exclude `/*`);
#                                the files themselves stay where they are, untouched
#   scripts/device/slim.sh off   back: the index from HEAD, the exclude line removed
# Only with nothing staged (`on` refuses otherwise); commit nothing while it is on (`on`
# installs a pre-commit hook that refuses commits until `off`).
set -euo pipefail
cd "$(dirname "$0")/../.."
case ${1:-} in
on)
    git diff --cached --quiet || { echo "slim.sh: staged changes; commit or unstage them first" >&2; exit 1; }
    # A commit made while slim is on would record the 9-file index: a hook refuses it.
    mkdir -p .git/hooks
    printf '#!/bin/sh\nif grep -qx "/\\*" .git/info/exclude 2>/dev/null; then echo "pre-commit: scripts/device/slim.sh is on; run slim.sh off first" >&2; exit 1; fi\n' \
        > .git/hooks/pre-commit
    chmod +x .git/hooks/pre-commit
    grep -qx '/\*' .git/info/exclude 2>/dev/null || echo '/*' >> .git/info/exclude
    git rm -r -q --cached .
    git add -f scripts/device tests/fixtures/golden/golden.json
    echo "slim.sh: $(git ls-files | wc -l) files tracked, $(git ls-files -z | xargs -0 cat | wc -c) bytes; untracked not ignored: $(git ls-files --others --exclude-standard | wc -l)"
    ;;
off)
    git reset -q
    sed -i '/^\/\*$/d' .git/info/exclude
    echo "slim.sh: index back to HEAD ($(git ls-files | wc -l) files)"
    ;;
*) echo "usage: slim.sh on|off" >&2; exit 2;;
esac
