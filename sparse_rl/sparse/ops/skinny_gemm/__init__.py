"""`ops.skinny_linear`: y = x @ wᵀ for the few rows of a decode step (M <= 32), split over K inside ONE
launch (the last program of each output tile sums the partials), where cuBLAS runs a split-K GEMM and a
separate reduce kernel."""
