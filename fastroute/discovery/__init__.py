"""Engines that join and leave at run time: the engines state file, DNS discovery, the merge.

* :mod:`~fastroute.discovery.state_file`: ``<config>.engines.json``, the admin API's
  engines, drain marks and the last discovered address sets (atomic, locked writes);
* :mod:`~fastroute.discovery.dns`: resolve a ``[[discovery]]`` name (A/AAAA or SRV);
* :mod:`~fastroute.discovery.runner`: re-resolve on a schedule, once per host;
* :mod:`~fastroute.discovery.merge`: config + state file + discovered engines = the fleet
  in force, for the proxy and the controller alike.
"""
