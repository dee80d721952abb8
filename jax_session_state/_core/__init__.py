"""The machinery under the public contract, shared by every kind: private, imported only inside the package.

Owns ``_validation`` (checks of sizes, payloads and options that name the
object, what was expected and what came), ``_writes`` (row writes that stay
in place under donation, natively where XLA:CPU would convert the whole
buffer), ``_library`` (the native CPU library built from ``csrc/``: loaded
once, its instruction-set path chosen, its XLA FFI targets registered),
``_crc32`` (zlib's CRC-32, natively where the CPU multiplies carry-less),
``_placement``
(where an object's arrays live and putting them back there; whether a
donated step took them) and ``_coordination`` (the key-value store of JAX's
distributed runtime, which the manager and checkpoints agree through).

May import: ``errors`` and ``accounting``. Everything else may import it.
"""
