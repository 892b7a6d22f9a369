"""Paged KV-cache bookkeeping: physical pools, block tables, exact cache identity, sharing.

Pure Python: imports no torch, no ray and nothing else of pagedserve. It emits plans (block ids,
copy and swap pairs) that the workers execute.
"""
