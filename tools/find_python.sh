#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, found on PATH or through
# pyenv; exits 1 with a clear message when there is none.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' \
       >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
  if ok "$PYTHON"; then command -v "$PYTHON"; exit 0; fi
  echo "error: PYTHON=$PYTHON is not a Python >= 3.12" >&2; exit 1
fi
for name in python3.12 python3.13 python3.14 python3 python; do
  path=$(command -v "$name" 2>/dev/null) || continue
  if ok "$path"; then echo "$path"; exit 0; fi
done
# pyenv: its shims need PYENV_VERSION, so look at the installed versions directly.
if command -v pyenv >/dev/null 2>&1 || [ -d "${PYENV_ROOT:-$HOME/.pyenv}" ]; then
  root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for v in $(ls -1 "$root/versions" 2>/dev/null | sort -V); do
    path="$root/versions/$v/bin/python3"
    if [ -x "$path" ] && ok "$path"; then echo "$path"; exit 0; fi
  done
fi
cat >&2 <<'MSG'
error: loc_opt needs Python 3.12 or newer (jax and flax require it), and none
was found on PATH (python3.12 .. python3.14, python3, python) or among pyenv's versions.
Install one (e.g. `pyenv install 3.12`) or point PYTHON=/path/to/python3.12.
MSG
exit 1
