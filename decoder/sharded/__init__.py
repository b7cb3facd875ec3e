"""A trunk split over the ranks of MLX's distributed world: sharding, rank 0 leading the others,
and a rank ending when its peer is gone."""
