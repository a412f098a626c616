"""Fleet benchmark harness and the process/fleet helpers the demo shares.

* :mod:`~fastroute.fleetbench.process` — child processes in their own sessions, stopped by group;
* :mod:`~fastroute.fleetbench.procstat` — CPU seconds and RSS of a process tree from ``/proc``;
* :mod:`~fastroute.fleetbench.fleet` — emulated fleet spec, port plan, runner process;
* :mod:`~fastroute.fleetbench.configgen` — the fastroute config of a fleet;
* :mod:`~fastroute.fleetbench.stack` — fleet + controller + proxies, run-unique shared memory;
* :mod:`~fastroute.fleetbench.scrape` — engine and proxy counters from ``/metrics``.
"""
