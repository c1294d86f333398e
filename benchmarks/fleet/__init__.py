"""The fleet benchmark's parts (benchmarks/bench_fleet.py is the entry point; issue 42).

One object per job:

- :mod:`.trace`: a prefix-block trace read, sampled by whole conversations, scaled
  (tokens per block, blocks per prompt, output lengths, time) and given token ids
  (:class:`~.trace.Workload`, :class:`~.trace.Request`);
- :mod:`.routers`: round-robin and a prefix-aware router (benchmark code, not product);
- :mod:`.stack`: the processes of one configuration (vLLM alone, our daemon, LMCache's
  multiprocess server in two modes, vLLM's native CPU offload) and its replicas;
- :mod:`.replay`: the open-loop replayer (streaming ``/v1/completions`` at the
  requests' arrival times, TTFT and end-to-end latency, the generated text);
- :mod:`.report`: per-configuration figures, the table, ratios and the TTFT CDF as an SVG.
"""
