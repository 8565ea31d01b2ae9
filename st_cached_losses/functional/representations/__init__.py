"""Rows that are not one dense vector, as plug-ins of the one core: late-interaction token rows
([`multi_vector`][st_cached_losses.functional.representations.multi_vector]), sparse rows kept compact
([`sparse`][st_cached_losses.functional.representations.sparse]) and SPLADE's FLOPS regulariser
([`flops`][st_cached_losses.functional.representations.flops]). Imports the shared floor only."""
