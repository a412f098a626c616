"""The request path: classify, admit, key, pick, forward, relay, record; with the fleet state
(engines, class rows, weights, eligibility, live per-engine statistics) it reads.
"""
