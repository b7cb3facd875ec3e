"""The networks and how their passes run fast: the trunk (mlx-lm's own model), the MTP head,
traced verify passes, few-row linears, the CUDA verify kernel and the BLAS MLX's CPU uses."""
