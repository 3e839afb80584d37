#!/bin/bash
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 280 python3 .gpu/rw_layers.py > $OUT/rw_layers.txt 2>&1; cat $OUT/rw_layers.txt | tail -8
