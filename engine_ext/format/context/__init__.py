"""Codec v2, the context-conditioned coder (coders ``ctx-rans``, format 9, and ``ctx``, format 5; spec:
docs/FORMAT.md): a tensor's changes coded given its base weights.

What is where:

* :mod:`.codec`: the coder: a part's header, its encoder, its decoders on the host (the streams, then the
  pass over the base) and the reader's checks;
* :mod:`.symbols`: which dtypes it codes and the step tables' limits (what a manifest is checked against);
* :mod:`.models`: the probability models publisher and ranks both build (classes over the exponent, step
  symbols, the version's *step tables*, the Golomb laws of gaps and counts);
* :mod:`.blocks`: the blocks a part is cut into where tensor parallelism cuts its tensor;
* :mod:`.scan_kernels`: the passes over a part's base, every core (numba; the decode pass also compiled, from
  ``scan_native.c``, the package's one C extension, optional: numba serves where it is not built);
* :mod:`.rans_stage` and :mod:`.rans_stage_kernels`: the ``ctx-rans`` layout of the symbols, block-major
  chunks a rank decodes alone, and its compiled loops;
* :mod:`.rans`: the static interleaved rANS coder under that stage. It lives here, not beside codec v1,
  because codec v2 is its only client and its constants (``M``, ``PROB_BITS``, ``RANS_L``) are part of
  the ``ctx-rans`` bytes: a change to it is a change to this codec's format.

Decoding on a device (a GPU rank's base stays where it is) is
:mod:`engine_ext.triton_kernels.context_decode`, above this package, not in it: it composes the Triton
kernels with the host-side pieces here (:func:`.codec.part_header`, :func:`.codec.held_blocks`,
:func:`.codec.decode_streams`, :func:`.rans_stage.plan`), so it imports both, while the byte format never
imports a kernel (tests/test_layers.py holds the rule). The reader, which knows where a base lives, picks
one decoder or the other. It has one implementation, so no interface stands between the two.

This package's face holds only :mod:`.symbols`' names, so that importing it (every manifest check does)
loads no numba: vLLM 0.32 CPU's plugin processes read manifests, and its kernel-override scan of
``sys.modules`` dies on numba's llvmlite (tests/test_compat.py). The coder itself is imported by module
(``from engine_ext.format.context import codec``) where it runs.
"""

from __future__ import annotations

from .symbols import MAX_STEP_TABLES, alphabet, supports

__all__ = ["MAX_STEP_TABLES", "alphabet", "supports"]
