"""Fleet benchmark harness and the process/fleet helpers the demo shares.

* :mod:`~fastroute.bench.process` — child processes in their own sessions, stopped by group;
* :mod:`~fastroute.bench.procstat` — CPU seconds and RSS of a process tree from ``/proc``;
* :mod:`~fastroute.bench.fleet` — emulated fleet spec, port plan, runner process;
* :mod:`~fastroute.bench.configgen` — the fastroute config of a fleet;
* :mod:`~fastroute.bench.stack` — fleet + controller + proxies, run-unique shared memory;
* :mod:`~fastroute.bench.scrape` — engine and proxy counters from ``/metrics``.
"""
