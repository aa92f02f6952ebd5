"""What the benchmark scripts share (no script imports another): `harness`, how a script runs and measures (its
options, timing, a process of its own, tables whose rows are printed and written as they are measured); `synthetic`,
random models and synthetic data of the real shapes; `tutorial`, the popular tutorial's way of writing the same
model, the reference every speed table compares with."""
