#!/bin/bash
# A/B: session-14 code (/tmp/old15) vs main, mlp pipeline and resnet data on TVM, alternating
mkdir -p /tmp/ab15
for r in 1 2; do
  for side in old new; do
    if [ $side = old ]; then d=/tmp/old15; else d=/work/main; fi
    cd $d
    PYTHONPATH=$d timeout 900 .venv/bin/python benchmarks/train_step.py --models mlp --backend tvm --configs "2 ranks pipeline 1f1b x8 (MPI)" --steps 10 --results-dir /tmp/ab15/$side$r > /tmp/ab15/$side$r.mlp.log 2>&1
    grep samples/s /tmp/ab15/$side$r.mlp.log | sed "s/^/$side$r /"
    PYTHONPATH=$d timeout 900 .venv/bin/python benchmarks/train_step.py --models resnet --backend tvm --configs "2 ranks data (MPI)" --steps 10 --results-dir /tmp/ab15/$side$r > /tmp/ab15/$side$r.rn.log 2>&1
    grep samples/s /tmp/ab15/$side$r.rn.log | sed "s/^/$side$r /"
    uptime
  done
done
