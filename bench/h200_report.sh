#!/usr/bin/env bash
# The H200 report from the committed results (no GPU needed): bench/report.sh h200, which merges
# the H200's databases into bench/results/merged/h200_all.db, writes docs/report-h200/ and the
# README's headline figure, docs/figures/headline-h200.png.
exec bash "$(dirname "$0")/report.sh" h200
