"""The proxy's HTTP layer: the lean HTTP/1.1 server clients talk to, the keep-alive client
to the engines, and the reply and error shapes the request path hands back.
"""
