"""The attention side: reference ops and kernels, the selectors, model patching, convert, loading."""
