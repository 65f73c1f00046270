#!/usr/bin/env bash
# last call of a sitting: final.sh with bench_gpu once per kind of host buffer (KINDS, SIZES)
KINDS=${KINDS:-default bytearray huge} exec bash .gpu/final.sh
