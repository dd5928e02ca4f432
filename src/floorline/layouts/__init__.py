"""On-disk layouts of the weight-only quantised formats, in plain torch: packing, unpacking,
dequantisation (the reference the libraries' kernels are checked against), and random weights
drawn directly in each layout, so that no quantiser or hub checkpoint is needed."""
