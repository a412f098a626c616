"""The proxy's background tasks (the signal and weights paths): table watcher, weights
puller, reporter to the controller, engine scraper, calibration pull.

aiohttp is used here only as an HTTP client; the proxy serves with its own lean server.
"""
