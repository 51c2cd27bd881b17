"""The byte format both sides share (spec: docs/FORMAT.md): the manifest, the codecs, dtypes
and their ordered steps, fingerprints, decoded deltas, grid cells, the fp8-block recipe.
Pure data and math: nothing here reads or writes a store, and nothing here imports one."""
