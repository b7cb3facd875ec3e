"""What a sequence keeps between passes and how it goes back: the cache protocol every cache kind
answers (caches.py), batched rows (batch_cache.py), bounded shapes (shapes.py), the prefix cache
(prefix.py), rollback (state.py) and recurrent replay (recording.py)."""
