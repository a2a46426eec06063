"""The global sampling plan: the category schedule, the classes drawn for each step, the dealing of a step to the
ranks and the packing rule both share. Pure functions of (seed, epoch, step, manifest): no reads, no communication."""
