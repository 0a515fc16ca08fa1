"""Data movement: Transpose/Reshape/Gather/Slice chains, GatherND, weight layouts."""
