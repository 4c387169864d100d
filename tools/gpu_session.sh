#!/usr/bin/env bash
# The GPU runs behind benchmarks/README.md and benchmarks/results/, one stage per argument; logs go to
# $OUT (or ./out). Run from the repository root.
#   bash tools/gpu_session.sh copybeside1 kernel1 fuzz1 fuzz1tiles compile1 merge1 plans1 ragged1 ownblock1 newdocs1 balance1 hostcost1 alone1 flex1 capture1 transport1 exchange1 graph1   # on 1 GPU
#   bash tools/gpu_session.sh fuzzlocal                  # on 1 GPU or more: local masks over zigzag, 3 and 4 ranks
#   bash tools/gpu_session.sh local2 sharding2 block2 reshard2 ownblock2 joined2 documents16k2 efficiency2 checkbymask2 check2 fuzz2 lendtrace2 check2flex check2lse transport2 graph2 lend2 passes2 ab2 bench2 layouts2 long2 masked2 documents2 phases2 newdocs2 million shortcausal   # on 2 (or more) GPUs
#   bash tools/gpu_session.sh links efficiency binding4 profile4 skew4 capturetests check4 check4mesh transport4 phases4 phases4docs gaps4 traces4 launch4 shardcost hostprofile4 phases4mesh sharding4 block4 documents4runs hostruns4 local4 mesh4 bench4   # on 4 GPUs
#   BASE=$PWD/.whl/base bash tools/gpu_session.sh streamorder1   # on 1 GPU: tests/gpu/test_stream_order.py fails on a tree before the race's fix (f3228ab), passes here
#   BASE=$PWD/.whl/base bash tools/gpu_session.sh basealone1   # on 1 GPU: rank 1's host phases alone, BASE and this tree
#   BASE=$PWD/.whl/base bash tools/gpu_session.sh basehostcost1   # on 1 GPU: host_cost's pieces, BASE's library and this tree's in turn, twice
#   BASE=$PWD/.whl/base bash tools/gpu_session.sh baseexchange1   # on 1 GPU: exchange_cost, BASE's library and this tree's in turn, twice
#   BASE=$PWD/.whl/base bash tools/gpu_session.sh base2   # on 2 GPUs; base4 basephases4 on 4: against another tree (git archive REV ringflex benchmarks tools | tar -x -C .whl/base)
#   bash tools/gpu_session.sh bench8                     # on 8 GPUs (8k, 32k, 128k tokens per GPU)
# One warm-up call is too few at 4 GPUs: the first timed calls still pay one-time costs.
# Needs the cuDNN frontend wheel in .whl/ (see shared/gpu/README.md).
set -uo pipefail
export OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The long-sequence training run: a model whose activations at this length do not fit one H200.
LONG="--seq-len 131072 --batch 1 --dim 4096 --layers 8 --heads 32 --kv-heads 8 --vocab 32 --lr 3e-4"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() { local name=$1; shift; echo "+ $*" | tee -a "$OUT/$name.log"; "$@" 2>&1 | grep -v "^W[0-9]* .*OMP_NUM_THREADS\|^\*\*\*\*" | tee -a "$OUT/$name.log"; }
# One probe (this tree's) with BASE's library and this tree's in turn, twice.
libraries() { local name=$1; shift; test -n "${BASE:-}" || { echo "$name needs BASE=<another tree>"; exit 2; }
              for round in 1 2; do for tree in "$BASE" "$PWD"; do run "$name" env PYTHONPATH=/tmp/site:$tree "$@"; done; done; }
tr() { local n=$1; shift; torchrun --standalone --nproc_per_node="$n" ${TORCHRUN_ARGS:-} "$@"; }  # TORCHRUN_ARGS: e.g. --numa-binding node
for stage in "$@"; do
  case $stage in
    env) run env python3 -m ringflex.env ;;
    check2) run check tr 2 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 ;;
    checkbymask2) run checkbymask2 tr 2 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 \
              --layouts by-mask default
              run checkbymask2 tr 2 -m tools.check_ring --device cuda --backend cudnn --local-len 8192 \
              --layouts by-mask default --cases prefix_lm documents causal sliding_window late_queries sparse_rows ;;  # shard_by_mask's shardings, and calls left in the default layout
    check2flex) run check tr 2 -m tools.check_ring --device cuda --backend flex --local-len 1024 ;;  # the ring on flex_attention
    check2lse) run check tr 2 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 --lse-grad ;;  # a loss reading the LSE
    hostcost1) run hostcost python3 -m benchmarks.probes.host_cost ;;  # host time of a ring call's pieces, one process
    alone1) for r in 1 2; do run alone1 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --calls 15 --one-at-a-time \
              --alone $r --cases ${CASES:-documents:zigzag documents:contiguous window:zigzag window:contiguous}; done ;;  # 4 ranks sharing one GPU: one rank's host by phase while the others sleep
    flex1) run flex python3 -m pytest -q tests/gpu/test_flex_kernel.py ;;  # the flex kernel vs the reference kernel
    copybeside1) run copybeside python3 -m benchmarks.probes.copy_beside_kernel ;;  # which copies run beside an attention kernel (2 GPUs for the peer rows)
    capture1) run capture python3 -m benchmarks.probes.capture_probe  # what CUDA-graph capture gives, one rank
              run capture tr 2 -m benchmarks.probes.capture_probe  # two ranks (sharing the GPU where there is one)
              run capture python3 -m pytest -q tests/gpu/test_capture.py ;;  # one- and two-rank calls replay to their values
    transport1) run transport python3 -m pytest -q tests/gpu/test_peer_transport.py tests/gpu/test_stream_order.py  # ranks share one GPU
                run check tr 2 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 ;;  # the ring over it
    exchange1) run exchange tr 2 -m benchmarks.probes.exchange_cost ;;  # host time of one copy-engine exchange (ranks share the GPU)
    graph1) run graph1 tr 1 -m benchmarks.bench --seq-lens 8192 16384 --masks causal documents --graph --no-cp \
              --iters 5 --warmup 2 --singles sdpa-cudnn ringflex-1gpu ;;  # one rank: eager vs graphs
    graph2) run graph2 tr 2 -m benchmarks.bench --seq-lens 16384 32768 --masks none causal window documents --graph \
              --layouts zigzag contiguous --no-cp --iters 5 --warmup 2 --singles sdpa-cudnn ringflex-1gpu \
              --json "$OUT/bench_graph.json" ;;  # eager vs graphs
    check2big) run check tr 2 -m tools.check_ring --device cuda --backend cudnn --local-len 4096 \
              --cases sliding_window documents prefix_lm combined_masks sparse_rows late_queries ;;  # blocks kept whole
    transport2) run transport python3 -m pytest -q tests/gpu/test_peer_transport.py ;;  # copy engines vs NCCL, failures
    merge1) run merge python3 -m pytest -q tests/gpu/test_fused_merge.py ;;  # the fused merge vs torch and fp64
    kernel1) run kernel python3 -m pytest -q tests/gpu/test_cudnn_kernel.py ;;  # every mod, offsets, fwd+bwd
    fuzz1) run fuzz tr 1 -m tools.fuzz_ring --no-gathers --seconds 240 ;;  # random calls, the cuDNN kernel alone
    fuzz1tiles) for n in 1 2; do run fuzz tr $n -m tools.fuzz_ring --no-gathers --tiles --seeds 3000 200 \
              --seconds 150; done ;;  # blocks planned from tiles, one rank and two sharing the GPU
    fuzz2) run fuzz tr 2 -m tools.fuzz_ring --seconds 400 ;;  # random calls over two ranks, gathers (flex) too
    fuzzlocal) for n in 3 4; do  # local masks over zigzag: joined steps on cuDNN (ranks may share a GPU);
                 # each run killed after 4 min: a broken CUDA context can leave the other ranks waiting
                 RINGFLEX_LENDING=0 run fuzzlocal timeout -s KILL 240 torchrun --standalone --nproc_per_node=$n \
                   -m tools.fuzz_ring --local-masks --seeds $((9000 * n)) 400 --seconds 150
               done ;;
    compile1) run compile python3 -m pytest -q tests/gpu/test_compiled_wrapper.py ;;  # torch.compile around a wrapped model
    plans1) run plans python3 -m benchmarks.probes.plan_probe --seq-len 8192 --window 1024 ;;  # every cuDNN plan and knob, timed
    ragged1) run ragged python3 -m benchmarks.probes.ragged_cost ;;  # ragged batch vs a call per document
    ownblock1) run ownblock1 python3 -m benchmarks.probes.own_block_cost --rows 8192 --windows 4096 512 ;;  # zigzag's own block: strided, ragged, a call per block
    balance1) for n in 16384 32768; do run balance1 python3 -m benchmarks.probes.balance_probe --seq-len $n; done
              run balance1 python3 -m benchmarks.probes.balance_probe --seq-len 16384 --layout zigzag --masks window documents causal none
              run balance1 python3 -m benchmarks.probes.balance_probe --seq-len 32768 --world-size 4 --masks window
              run balance1 python3 -m benchmarks.probes.balance_probe --seq-len 16384 --masks documents --doc-len 1024 ;;  # lending: each rank's work alone
    newdocs1) run newdocs1 python3 -m benchmarks.probes.extents_cost  # planning one block exactly: every pair vs tiles
              for a in "16384 150" "65536 100"; do set -- $a; run newdocs1 python3 -m benchmarks.probes.new_documents_probe \
              --seq-len $1 --calls $2 --profile 10; done  # one rank's hops, a new packed batch every call: graphs built
              for d in 4096 1024; do run newdocs1 python3 -m benchmarks.probes.new_documents_probe --seq-len 65536 --doc-len $d \
              --heads 1 --check; done ;;  # those hops (whole 32k-row blocks) against the reference kernel
    ab2) for t in nccl auto; do export RINGFLEX_TRANSPORT=$t; run ab2 tr 2 -m benchmarks.bench --seq-lens 16384 \
              --masks none causal --no-cp --single-max 0 --iters 10 --warmup 3; done; unset RINGFLEX_TRANSPORT ;;
    links) nvidia-smi topo -m | tee "$OUT/links.log"
           run links tr 4 -m benchmarks.probes.link_bandwidth
           CUDA_VISIBLE_DEVICES=0,1 run links tr 2 -m benchmarks.probes.link_bandwidth ;;  # a block's move, each way
    efficiency) run efficiency tr 4 -m benchmarks.bench --seq-lens 32768 --masks none causal --layouts zigzag \
              --singles sdpa-cudnn ringflex-1gpu --no-flex-cp --iters ${ITERS:-20} --warmup 3 --json "$OUT/efficiency4.json"
              CUDA_VISIBLE_DEVICES=0,1 bash "$0" efficiency2 ;;  # 8k tokens per GPU, with torch CP; and on 2 of the GPUs
    base4) test -n "${BASE:-}" || { echo "base4 needs BASE=<another tree: git archive REV ringflex benchmarks tools>"; exit 2; }
           for round in $(seq "${ROUNDS:-2}"); do for tree in "$BASE" "$PWD"; do name=$(basename "$tree")  # -m imports from the tree's folder
             (cd "$tree" && run base4 python3 -c 'import ringflex; print("ringflex from", ringflex.__file__)'
             for n in ${SEQ_LENS:-32768}; do run base4 tr 4 -m benchmarks.bench --seq-lens $n --masks ${MASKS:-none causal} \
               --layouts ${LAYOUTS:-zigzag} --single-max 0 --no-cp --no-flex-cp --iters ${ITERS:-10} --warmup 3 \
               --json "$OUT/base4_${name}_${n}_$round.json"; done); done; done ;;  # this tree against BASE, 4 GPUs, alternately
    binding4) for round in $(seq "${ROUNDS:-2}"); do for b in none node core-complex; do
                [ $b = none ] && unset TORCHRUN_ARGS || export TORCHRUN_ARGS="--numa-binding $b"
                run binding4 tr 4 -m benchmarks.bench --seq-lens 32768 --masks documents window causal --layouts zigzag \
                  contiguous --single-max 0 --no-cp --no-flex-cp --iters 10 --warmup 3 --json "$OUT/binding4_${b}_8k_$round.json"
                run binding4 tr 4 -m benchmarks.bench --seq-lens 65536 --masks documents --layouts contiguous --single-max 0 \
                  --no-cp --no-flex-cp --iters 10 --warmup 3 --json "$OUT/binding4_${b}_16k_$round.json"; done; done
              unset TORCHRUN_ARGS ;;  # each rank's threads on the CPUs near its GPU (torchrun --numa-binding) or anywhere
    streamorder1) test -n "${BASE:-}" || { echo "streamorder1 needs BASE=<a tree before the fix: git archive f3228ab ringflex>"; exit 2; }
           mkdir -p "$BASE/tests/gpu" && cp -r tests/support tests/conftest.py "$BASE/tests/" && cp tests/gpu/test_stream_order.py "$BASE/tests/gpu/"
           echo "+ test_stream_order on $BASE (must fail)" | tee -a "$OUT/streamorder.log"
           (cd "$BASE" && PYTHONPATH=/tmp/site:$BASE timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider \
              tests/gpu/test_stream_order.py) 2>&1 | tail -25 | tee -a "$OUT/streamorder.log"
           run streamorder timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stream_order.py ;;  # must pass here
    base2) test -n "${BASE:-}" || { echo "base2 needs BASE=<another tree: git archive REV ringflex benchmarks tools>"; exit 2; }
           for round in $(seq "${ROUNDS:-2}"); do for tree in "$BASE" "$PWD"; do name=$(basename "$tree")
             (cd "$tree" && run base2 python3 -c 'import ringflex; print("ringflex from", ringflex.__file__)'
             run base2 tr 2 -m benchmarks.bench --seq-lens ${SEQ_LENS:-16384} --masks ${MASKS:-window documents causal none} \
               --layouts ${LAYOUTS:-zigzag contiguous} --singles ${SINGLES:-sdpa-cudnn} --no-cp --no-flex-cp \
               --iters ${ITERS:-20} --warmup 3 --json "$OUT/base2_${name}_$round.json"); done; done ;;  # this tree against BASE, 2 GPUs, alternately
    basephases4) test -n "${BASE:-}" || { echo "basephases4 needs BASE=<another tree>"; exit 2; }
           cp benchmarks/probes/host_phases.py "$BASE/benchmarks/probes/"  # one probe, two libraries
           for round in $(seq "${ROUNDS:-2}"); do for tree in "$BASE" "$PWD"; do
             (cd "$tree" && run basephases4 python3 -c 'import ringflex; print("ringflex from", ringflex.__file__)'
             run basephases4 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --no-timers --calls 40 \
               --cases ${CASES:-documents:contiguous window:contiguous window:zigzag causal:zigzag}); done; done ;;  # host ms per call, this tree against BASE
    basehostcost1) libraries basehostcost1 python3 benchmarks/probes/host_cost.py ;;
    baseexchange1) libraries baseexchange1 torchrun --standalone --nproc_per_node=2 benchmarks/probes/exchange_cost.py ;;
    basealone1) test -n "${BASE:-}" || { echo "basealone1 needs BASE=<another tree>"; exit 2; }
           cp benchmarks/probes/host_phases.py "$BASE/benchmarks/probes/"  # one probe, two libraries
           for tree in "$BASE" "$PWD"; do (cd "$tree" && run basealone1 python3 -c 'import ringflex; print("ringflex from", ringflex.__file__)'
             run basealone1 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --calls 15 --one-at-a-time --alone 1 \
               --cases ${CASES:-documents:zigzag documents:contiguous}); done ;;  # 4 ranks sharing one GPU: rank 1's host by phase alone, BASE and this tree
    basezigzag4) test -n "${BASE:-}" || { echo "basezigzag4 needs BASE=<another tree>"; exit 2; }
           for tree in "$BASE" "$PWD"; do (cd "$tree" && run basezigzag4 tr 4 -m benchmarks.probes.host_phases \
               --seq-len 32768 --calls 30 --cases window:zigzag); done ;;  # the window over zigzag by phase, BASE and this tree
    pace) for flag in "" "--lag 2" "--lag 4" --gc-off; do run pace tr 4 -m benchmarks.probes.iteration_times --seq-len 32768 $flag
            CUDA_VISIBLE_DEVICES=0,1 run pace tr 2 -m benchmarks.probes.iteration_times --seq-len 16384 $flag
          done ;;  # each of 40 back-to-back calls' GPU time: a steady pace, or stalls now and then
    graph4) run graph4 tr 4 -m benchmarks.bench --seq-lens 32768 --masks none causal --layouts zigzag --graph \
              --no-cp --no-flex-cp --singles sdpa-cudnn --iters 5 --warmup 3 --json "$OUT/graph4.json"
            CUDA_VISIBLE_DEVICES=0,1 run graph4 tr 2 -m benchmarks.bench --seq-lens 16384 --masks none causal \
              --layouts zigzag --graph --no-cp --no-flex-cp --singles sdpa-cudnn --iters 5 --warmup 3 \
              --json "$OUT/graph2.json" ;;  # eager vs CUDA graphs: how much of the gap is the host's
    documents16k) run documents16k tr 4 -m benchmarks.bench --seq-lens 65536 --masks documents \
              --layouts contiguous by-mask --singles ringflex-1gpu --no-flex-cp --iters 10 --warmup 5 \
              --json "$OUT/documents16k.json" ;;  # packed documents at 16k tokens per GPU against one GPU
    mesh32k) run mesh32k tr 4 -m benchmarks.bench_mesh --tokens-per-rank 32768 --masks causal none documents \
              --iters 3 --warmup 1 --rounds 2 --json "$OUT/mesh32k.json" ;;  # meshes and torch's CP at 32k per GPU
    check4) run check tr 4 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 ;;
    transport4) run transport python3 -m pytest -q tests/gpu/test_peer_transport.py ;;  # every channel, on 2 and 4 ranks
    phases4mesh) for flag in "" --forward-only; do for mesh in 4x1 2x2; do
                   run phases4mesh tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --mesh $mesh \
                     --cases causal:zigzag documents:zigzag --calls 20 $flag; done
                 run phases4mesh tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --cases causal:zigzag \
                   documents:zigzag --calls 20 $flag; done ;;  # where a mesh call's host time goes, 8k tokens per GPU
    phases4) for flag in "" --forward-only; do run phases4 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 \
               --cases documents:contiguous window:contiguous window:zigzag causal:zigzag --calls 20 $flag; done ;;  # the pure ring's host time by phase, 8k tokens per GPU
    phases4docs) run phases4docs tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --cases documents:contiguous \
                   --calls 30
                 run phases4docs tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --cases documents:contiguous \
                   --calls 30 --no-timers ;;  # packed documents' host time by phase, and without the timers
    traces4) dir=$(mktemp -d); for n in 4 2; do CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) run traces4 tr $n \
               -m benchmarks.profile_ring --seq-lens $((8192 * n)) --masks causal none window --gpu-only --iters 10 \
               --profiled-calls 5 --trace "$dir/tr${n}_{}.json.gz"; done
             tar czf "$OUT/traces4.tgz" -C "$dir" . ;;  # every rank's chrome trace, in one file (a run returns few files); read with --timelines
    gaps4) run gaps4 tr 4 -m benchmarks.profile_ring --seq-lens 32768 --masks causal none --iters 5 --hot 40 --profiled-calls 3 \
             --with-stack
           CUDA_VISIBLE_DEVICES=0,1 run gaps4 tr 2 -m benchmarks.profile_ring --seq-lens 16384 --masks none causal --hot 80 \
             --iters 5 --profiled-calls 3 --with-stack ;;  # what the host runs while the GPUs idle, 8k tokens per GPU, at the power limit
    skew4) dir=$(mktemp -d)
           nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader \
             -lms 25 > "$dir/clocks.csv" & sampler=$!
           run skew4 tr 4 -m benchmarks.profile_ring --seq-lens 32768 --masks causal --iters 5 --hot 40 --profiled-calls 3 \
             --gpu-only --trace "$dir/skew_{}.json.gz"
           kill $sampler; tar czf "$OUT/skew4.tgz" -C "$dir" . ;;  # every rank's trace at the power limit and the GPUs' clocks beside it (--timelines reads the traces)
    capturetests) run capturetests python3 -m pytest -q tests/gpu/test_capture.py tests/gpu/test_moves.py ;;  # CUDA-graph capture and replay of ring passes, re-sharding moves
    launch4) CUDA_VISIBLE_DEVICES=0 run launch4 python3 -m benchmarks.probes.launch_cost
             run launch4 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --no-timers --calls 30 --ab-launch 6 \
               --cases documents:contiguous window:zigzag causal:zigzag ;;  # the fused merge launched directly vs the JIT
    sends4) run sends4 tr 4 -m tools.check_ring --device cuda --backend cudnn --local-len 1024
            run sends4 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 --no-timers --calls 30 --ab-sends 6 \
              --cases window:zigzag documents:zigzag documents:contiguous causal:zigzag none:zigzag ;;  # early sends: checked, then in turn
    shardcost) run shardcost python3 -m benchmarks.sharding_model --world-sizes ${WORLD_SIZES:-4} --device cuda ;;  # shard_by_mask's host time, ids on the GPU
    hostprofile4) run hostprofile4 tr 4 -m benchmarks.profile_ring --seq-lens 32768 --masks documents --layout contiguous \
                    --iters 5 --profiled-calls 2 --gpu-only --host-profile 30 --host-profile-rank 2
                  run hostprofile4 tr 4 -m benchmarks.profile_ring --seq-lens 32768 --masks window --layout zigzag \
                    --iters 5 --profiled-calls 2 --gpu-only --host-profile 30 --host-profile-rank 1 ;;  # cProfile of a host-bound rank
    check4mesh) run check tr 4 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 --mesh 2x2 \
                  --layouts zigzag contiguous  # the heads x ring mesh against one device
                run check tr 4 -m tools.check_ring --device cuda --backend cudnn --local-len 1024 --mesh 4x1 \
                  --layouts zigzag ;;
    gputests) run gputests python3 -m pytest -q -n 4 tests/gpu ;;  # every GPU test, four at a time on one GPU
    sharding4) run sharding4 tr 4 -m benchmarks.bench --seq-lens 32768 --masks documents window causal prefix_lm \
              --layouts default zigzag contiguous by-mask --iters 10 --warmup 5 --json "$OUT/sharding4.json" ;;  # vs flex CP
    block4) run block4 tr 4 -m benchmarks.bench_block --seq-lens 32768 --masks window documents causal \
              --layouts default zigzag contiguous by-mask --json "$OUT/block4.json" ;;  # 8k tokens per GPU: a transformer block around the ring, per sharding
    local4) run local4 tr 4 -m benchmarks.bench --seq-lens 32768 --masks window documents causal --layouts zigzag \
              contiguous --single-max 0 --no-cp --no-flex-cp --iters 5 --warmup 3 --json "$OUT/local4.json" ;;  # local masks over zigzag (two blocks, straight from their owners) and contiguous
    documents4runs) for n in $(seq "${RUNS:-3}"); do run documents4runs tr 4 -m benchmarks.bench --seq-lens 32768 \
              --masks documents --layouts contiguous --single-max 0 --no-cp --iters 10 --warmup 3 --rounds 3 \
              --json "$OUT/documents4_run$n.json"; done ;;  # against flex CP in fresh processes: the host time moves between them
    hostruns4) for n in $(seq "${RUNS:-5}"); do run hostruns4 tr 4 -m benchmarks.probes.host_phases --seq-len 32768 \
              --no-timers --calls 40 --cases documents:contiguous; done ;;  # each fresh process's host time, and where its busy threads ran
    mesh4) run mesh4 tr 4 -m benchmarks.bench_mesh --tokens-per-rank 8192 --masks none causal documents \
              --json "$OUT/mesh4.json" ;;  # heads x ring meshes 1x4, 2x2, 4x1 against the pure ring
    examples2) run examples2 tr 2 examples/train_example.py --device cuda --dtype bfloat16 --seq-len 8192 \
              --steps 4 --progress-every 1
              run examples2 tr 2 examples/hf_finetune.py --device cuda --backend reference
              run examples2 tr 4 examples/fsdp_cp.py --device cuda --backend reference ;;  # the examples on GPUs (fp64 ones on the reference kernel)
    bench2) run bench2 tr 2 -m benchmarks.bench --seq-lens 16384 32768 --iters 5 --warmup 2 \
              --json "$OUT/bench2.json" --plot "$OUT/efficiency_2gpu.png" ;;
    layouts2) for n in 16384 32768; do run layouts2 tr 2 -m benchmarks.bench --seq-lens $n --layouts zigzag striped \
              --no-cp --iters 5 --warmup 2 --json "$OUT/layouts2_$n.json"; done ;;  # the ring in both balanced layouts
    long2) run long2 tr 2 -m benchmarks.bench --seq-lens 65536 --masks none causal window documents \
              --layouts zigzag striped --no-cp --iters 3 --warmup 2 --json "$OUT/layouts2_65536.json"
           run long2 tr 2 -m benchmarks.bench --seq-lens 16384 32768 65536 --masks window documents \
              --layouts contiguous --no-cp --iters 3 --warmup 2 --json "$OUT/contiguous.json" ;;
    masked2) run masked2 tr 2 -m benchmarks.bench --seq-lens 16384 32768 65536 --masks window documents \
              --layouts zigzag striped contiguous --no-cp --iters 3 --warmup 2 --json "$OUT/masked2.json" ;;
    documents2) for d in 4096 1024; do run documents2 tr 2 -m benchmarks.bench --seq-lens 16384 32768 --masks documents \
              --doc-len $d --layouts contiguous zigzag --no-cp --singles ringflex-1gpu --iters 5 --warmup 2 \
              --json "$OUT/documents2_$d.json"; done ;;  # ragged batches, against ringflex's own kernel on one GPU
    lend2) for l in 0 auto 1; do export RINGFLEX_LENDING=$l; run lend2 tr 2 -m benchmarks.bench --seq-lens 16384 32768 \
              --masks window documents causal --layouts contiguous --no-cp --singles sdpa-cudnn ringflex-1gpu \
              --graph --iters 5 --warmup 2 --json "$OUT/lend2_$l.json"; done; unset RINGFLEX_LENDING ;;  # lending off / by default / at any size
    passes2) run passes2 tr 2 -m benchmarks.probes.ring_passes --seq-len 16384 --masks causal none --layout zigzag
             run passes2 tr 2 -m benchmarks.probes.ring_passes --seq-len 16384 --masks window documents --layout contiguous ;;  # passes outside the kernels
    block2) run block2 tr 2 -m benchmarks.bench_block --seq-lens 16384 --masks window documents causal \
              --layouts default zigzag contiguous by-mask --json "$OUT/block2.json" ;;  # 8k tokens per GPU: a transformer block around the ring, per sharding
    shortcausal) run shortcausal tr "$ngpu" -m benchmarks.bench --seq-lens $((1024 * ngpu)) $((4096 * ngpu)) --masks causal \
              --layouts default zigzag contiguous by-mask --no-cp --no-flex-cp --single-max 0 --iters 20 --warmup 5 \
              --json "$OUT/shortcausal.json" ;;  # short causal calls, bound by the host: where the cost model prices contiguous below zigzag
    sharding2) run sharding2 tr 2 -m benchmarks.bench --seq-lens 16384 --masks ${MASKS:-window documents causal prefix_lm} \
              --layouts default zigzag contiguous by-mask --singles sdpa-cudnn ringflex-1gpu --iters 10 --warmup 3 \
              --json "$OUT/sharding2.json" ;;  # 8k tokens per GPU: the default layout against shard_by_mask's, vs flex CP
    reshard2) run reshard2 python3 -m pytest -q tests/gpu/test_moves.py  # moves over the copy engines, bit for bit
              run reshard2 tr 2 -m benchmarks.bench --seq-lens 16384 --masks ${MASKS:-window documents} \
              --layouts default zigzag contiguous by-mask moved --singles ringflex-1gpu --no-cp --no-flex-cp --iters 10 --warmup 3 \
              --json "$OUT/reshard2.json" ;;  # 8k tokens per GPU: what re-sharding a call costs, vs staying in zigzag
    ownblock2) run ownblock2 python3 -m pytest -q tests/gpu/test_cudnn_kernel.py -k "diagonal_blocks or packed_documents"
              run ownblock2 tr 2 -m benchmarks.bench --seq-lens 16384 --masks ${MASKS:-documents window} \
              --layouts zigzag contiguous by-mask --singles ringflex-1gpu --no-cp --no-flex-cp --iters 10 --warmup 3 \
              --json "$OUT/ownblock2.json" ;;  # 8k tokens per GPU: zigzag (a rank's own diagonal blocks in one call) vs the others
    joined2) run joined2 tr 2 -m benchmarks.probes.host_phases --seq-len 16384 --no-timers --calls 30 --ab-joined 6 \
              --cases documents:zigzag documents:contiguous  # a rank's own diagonal blocks in one call or two, in turn
             run joined2 tr 2 -m benchmarks.probes.host_phases --seq-len 16384 --calls 20 --cases documents:zigzag ;;  # its phases
    documents16k2) run documents16k2 tr 2 -m benchmarks.bench --seq-lens 32768 --masks documents \
              --layouts contiguous by-mask --singles ringflex-1gpu --iters 5 --warmup 3 \
              --json "$OUT/documents16k2.json" ;;  # packed documents at 16k tokens per GPU against one GPU and flex CP
    efficiency2) run efficiency2 tr 2 -m benchmarks.bench --seq-lens 16384 --masks none causal --layouts zigzag \
              --singles sdpa-cudnn ringflex-1gpu --no-flex-cp --iters ${ITERS:-20} --warmup 3 \
              --json "$OUT/efficiency2.json" ;;  # 8k tokens per GPU, with torch CP; 20 calls: the first of a loop pay for starting it
    local2) run local2 tr 2 -m benchmarks.probes.host_phases --seq-len 16384 --calls 20 \
              --cases documents:zigzag documents:contiguous window:zigzag window:contiguous  # per rank, by phase
            mkdir -p "$OUT/traces" && for l in zigzag contiguous; do run local2 tr 2 -m benchmarks.profile_ring \
              --seq-lens 16384 --masks documents window --layout $l --gpu-only --profiled-calls 4 \
              --trace "$OUT/traces/${l}_{}.json.gz"; done && tar -C "$OUT" -czf "$OUT/traces_local.tgz" traces \
              && rm -r "$OUT/traces" ;;  # windows and documents over zigzag and contiguous: where zigzag's extra time goes
    phases2) run phases2 tr 2 -m benchmarks.probes.host_phases --seq-len 16384 ;;  # host time of a ring call by phase
    newdocs2) for n in 16384 65536; do run newdocs2 tr 2 -m benchmarks.probes.host_phases --seq-len $n --warmup 100 --calls 20 \
              --cases new_documents:contiguous new_documents:zigzag documents:contiguous; done ;;  # new packed batch every call
    bench4) run bench4 tr 4 -m benchmarks.bench --seq-lens 32768 131072 --masks none causal documents \
              --iters 5 --warmup 3 --json "$OUT/bench4.json" --plot "$OUT/efficiency_4gpu.png" ;;
    bench8) run bench8 tr 8 -m benchmarks.bench --seq-lens 65536 262144 1048576 --masks none causal documents \
              --single-max 262144 --iters 5 --warmup 3 --json "$OUT/bench8.json" --plot "$OUT/efficiency_8gpu.png" ;;
    million) run million tr 2 -m benchmarks.bench --seq-lens 1048576 --masks causal --single-max 0 --no-cp \
              --iters 1 --warmup 0 --json "$OUT/million.json" ;;
    profile2) run profile2 tr 2 -m benchmarks.profile_ring --seq-lens 16384 32768 --masks causal none documents \
              --trace "$OUT/ring_trace.json.gz" ;;
    profile4) mkdir -p "$OUT/traces" && run profile4 tr 4 -m benchmarks.profile_ring --seq-lens 32768 \
              --masks causal none documents --trace "$OUT/traces/ring_{}.json.gz" \
              && tar -C "$OUT" -czf "$OUT/traces4.tgz" traces && rm -r "$OUT/traces" ;;
    profile4gpu) mkdir -p "$OUT/traces" && run profile4gpu tr 4 -m benchmarks.profile_ring --seq-lens 32768 \
              --masks causal none --gpu-only --profiled-calls 6 --host-profile 20 --trace "$OUT/traces/ring_{}.json.gz" \
              && CUDA_VISIBLE_DEVICES=0,1 run profile4gpu tr 2 -m benchmarks.profile_ring --seq-lens 16384 \
              --masks causal none --gpu-only --profiled-calls 6 --trace "$OUT/traces/ring_{}.json.gz" \
              && tar -C "$OUT" -czf "$OUT/traces4gpu.tgz" traces && rm -r "$OUT/traces" ;;  # the GPUs at the host's own pace
    check4default) run check tr 4 -m tools.check_ring --device cuda --backend cudnn --local-len 4096 \
              --layouts default zigzag --cases sliding_window documents causal ;;  # calls that re-shard inside (NCCL)
    profile8k) mkdir -p "$OUT/traces" && run profile8k tr 2 -m benchmarks.profile_ring --seq-lens 16384 \
              --masks causal none documents --trace "$OUT/traces/ring_{}.json.gz" \
              && tar -C "$OUT" -czf "$OUT/traces.tgz" traces && rm -r "$OUT/traces" ;;
    lendtrace2) mkdir -p "$OUT/traces"; export RINGFLEX_LENDING=1  # where the window's lending loses 0.4 ms at 8k per GPU
              run lendtrace2 tr 2 -m benchmarks.profile_ring --seq-lens 16384 --masks window --layout contiguous \
              --trace "$OUT/traces/ring_{}.json.gz" && tar -C "$OUT" -czf "$OUT/traces_lending.tgz" traces && rm -r "$OUT/traces"
              unset RINGFLEX_LENDING ;;
    trainprof) run trainprof tr 2 --no-python sh -c 'if [ "$LOCAL_RANK" = 0 ]; then p="-m cProfile -o $OUT/train.prof"; fi;
              exec python3 $p examples/train_example.py --device cuda --dtype bfloat16 --seq-len 16384 --batch 1 \
              --dim 256 --layers 2 --heads 4 --kv-heads 2 --packed --steps 8 --progress-every 0' ;;
    train1) run train1 python3 examples/train_example.py --device cuda --dtype bfloat16 $LONG --steps 2 ;;  # runs out of memory
    train2) run train2 tr 2 examples/train_example.py --device cuda --dtype bfloat16 $LONG --steps 12 \
              --progress-every 0 --out "$OUT/train2.json" ;;
    *) echo "unknown stage $stage (have $ngpu GPUs)"; exit 2 ;;
  esac
done
