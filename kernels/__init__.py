"""Device code for the paged KV cache: KV writes, paged attention, block copies and swaps.

Functions over tensors only: no requests, no block objects, no Ray.
"""
