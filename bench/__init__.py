"""Benchmark harness: the proxy's added latency, throughput, CPU and memory next to a direct
call to the simulated upstream and a bare passthrough on the same stack (the floor), measured
in one run on one machine (`python -m bench.run`); reports at scale (`python -m bench.reports`)."""
