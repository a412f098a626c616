"""``python -m controller``: the control-plane process (not built yet; see issue 5)."""

import sys

if __name__ == "__main__":
    sys.exit("fastroute controller is not implemented yet (issue 5: control plane)")
