"""Benchmark harness: the proxy's added latency, throughput, CPU and memory next to a direct
call to the simulated upstream, measured in one run on one machine (`python -m bench.run`)."""
