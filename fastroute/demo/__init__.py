"""``fastroute demo``: the embedded default — fleet, controller and proxies on loopback.

* :mod:`~fastroute.demo.scenario` — the embedded fleet and workload;
* :mod:`~fastroute.demo.runner` — start, drive, summarise, stop;
* :mod:`~fastroute.demo.report` — the printed table and URLs;
* :mod:`~fastroute.demo.cli` — the subcommand.
"""
