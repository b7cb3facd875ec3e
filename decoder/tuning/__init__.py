"""What this machine measures and decides: the depth policy (policy.py), the cost curve and its
measurement (curve.py, costs.py, batch_costs.py), kernel and dtype choices, and the on-disk store
they all keep (store.py)."""
