"""fastroute control plane: collects signals, solves the routing LP, publishes weights.

Imports flow one way: ``controller`` may import ``fastroute.{tables,signals,config,errors,policy}``;
``fastroute`` never imports ``controller`` (the CLI imports it lazily).
"""

__all__: list[str] = []
