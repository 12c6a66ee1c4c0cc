#!/usr/bin/env bash
# Small token counts on a CUDA machine (docs/small_tokens.md): the compiled-path tests, then the
# GPT step at small and large token counts, eager / compiled / CUDA graphs, the host profile, the
# graph-captured site and its kernels, the coefficient kernels' small-token sweep, V4 decoding.
#   bash scripts/small_tokens_gpu.sh tests|gpt-2k|eager-ab|compile|host|host-compiled|large|site|site-ab|sweep|split|aoti|decode|table-1024|table-4096
set -uo pipefail
out=${OUT:-results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(compgen -G ".whl/tf/*.whl") >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# Inductor compiles C++ (cpp_wrapper, AOTInductor packages) with $CXX. On the H100 image that is a
# wrapper (/opt/gcc/bin/g++) whose package libraries crash on load (docs/small_tokens.md); the
# system's g++ builds ones that load.
image_cxx=${CXX:-}
case ${CXX:-} in /opt/gcc/*) [ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ ;; esac
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
bench="python3 examples/benchmark_mixing.py --tables model --repeats 3"
for stage in "$@"; do
  case $stage in
    tests)  # in 4 worker processes where pytest-xdist is installed (the kernels compile in parallel)
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
      python3 -m pytest -q -p no:cacheprovider $workers tests/test_small_tokens.py tests/test_coefficient_backward.py \
        tests/test_compiled_gpu.py tests/test_export.py tests/test_capture_gpu.py tests/test_mixing_gpu.py \
        tests/test_mixing_fused.py tests/test_mixing_chain_gpu.py tests/test_sinkhorn_gpu.py tests/test_launch.py tests/test_losses_gpu.py 2>&1 | tee "$out/tests.log" ;;
    gpt-2k) $bench --models 1024 --arms plain mhc mhc-chain --modes eager compiled graphs --batch 2 --seq 1024 \
             --out-dir "$out/gpt_2k" 2>&1 | tee "$out/gpt_2k.log" ;;
    compile)  # the first compiled step with and without the write-analysis cache (mhc/_write_analysis.py);
      # Inductor's own caches off, so that neither run reuses the other's compiled graphs
      # (without it, plain and mhc only: mhc took 98-122 s before)
      for cache in 1 0; do
        arms="plain mhc mhc-chain"; [ $cache = 0 ] && arms="plain mhc"
        TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 MHC_WRITE_ANALYSIS_CACHE=$cache $bench --models 1024 \
          --arms $arms --modes compiled --batch 2 --seq 1024 --repeats 1 \
          --out-dir "$out/compile_cache_$cache" 2>&1 | tee "$out/compile_cache_$cache.log"
      done ;;
    site) python3 scripts/site_kernels.py --out "$out/site_kernels.txt" 2>&1 | tee "$out/site.log" ;;
    site-ab)  # before (the package under .old/, when there) and after, in one call
      for arm in before after; do
        [ $arm = before ] && { [ -d .old/mhc ] || continue; }
        ( [ $arm = before ] && export PYTHONPATH=$PWD/.old:$PYTHONPATH
          python3 scripts/site_kernels.py --dims 1024 4096 --tokens 1024 2048 4096 16384 \
            --out "$out/site_kernels_$arm.txt" 2>&1 | tee "$out/site_$arm.log" )
      done ;;
    eager-ab)  # the eager GPT at 2k tokens pinned to one host core, before (.old/) and after, alternated
      # (ORDER: the processes' order, "before after before after" unless given)
      for arm in ${ORDER:-before after before after}; do
        [ $arm = before ] && { [ -d .old/mhc ] || continue; }
        ( [ $arm = before ] && export PYTHONPATH=$PWD/.old:$PYTHONPATH
          echo "## $arm"; taskset -c 5 $bench --models 1024 --arms plain mhc mhc-chain --modes eager --batch 2 \
            --seq 1024 --out-dir "$out/eager_ab_$arm" ) 2>&1 | tee -a "$out/eager_ab.log"
      done ;;
    sweep) python3 scripts/tune_mixing.py small-tokens 2>&1 | tee "$out/sweep.log" ;;
    split) python3 scripts/tune_mixing.py small-tokens-split 2>&1 | tee "$out/split.log" ;;
    aoti)  # with the image's compiler, then with the one set above
      for cxx in "$image_cxx" "$CXX"; do
        CXX=$cxx python3 scripts/aoti_load_probe.py "$(mktemp -d)" 2>&1 | tee -a "$out/aoti_probe.log"
      done ;;
    decode) python3 examples/deepseek_v4.py --bench-decode 2>&1 | tee "$out/decode.log" ;;
    host) python3 scripts/profile_host.py --arms mhc mhc-chain 2>&1 | tee "$out/host_profile.log" ;;
    host-compiled) python3 scripts/profile_host.py --arms plain mhc mhc-chain --mode compiled 2>&1 \
             | tee "$out/host_profile_compiled.log" ;;
    large) $bench --models 1024 --arms plain mhc mhc-chain --modes eager compiled --batch 16 --seq 1024 \
             --out-dir "$out/large_1024" 2>&1 | tee "$out/large_1024.log"
           $bench --models 4096 --arms plain mhc mhc-chain --modes eager compiled --batch 8 --seq 1024 \
             --out-dir "$out/large_4096" 2>&1 | tee "$out/large_4096.log" ;;
    table-1024|table-4096)  # pinned to one host core; BATCHES: sequences of 1k tokens per step (a
      # whole table takes longer than one device call allows: a few batch sizes per call)
      dim=${stage#table-}
      for batch in ${BATCHES:-1 2 4 8 16}; do
        taskset -c 5 $bench --models $dim --arms plain mhc mhc-chain liger --modes eager compiled graphs \
          --seq 1024 --batch $batch --out-dir "$out/table_${dim}_$batch" 2>&1 | tee -a "$out/table_$dim.log"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
