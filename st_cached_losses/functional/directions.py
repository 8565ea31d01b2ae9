"""The drivers' former home, split by job: [`binding`][st_cached_losses.functional.binding], [`local`][st_cached_losses.functional.local], [`ring`][st_cached_losses.functional.ring], [`autograd`][st_cached_losses.functional.autograd]
and [`options`][st_cached_losses.functional.options]; this path re-exports their names."""

from st_cached_losses.functional.autograd import InfoNCEFunction
from st_cached_losses.functional.binding import Solution
from st_cached_losses.functional.local import terms_solve
from st_cached_losses.functional.options import Guide, Keys, LossSpec
from st_cached_losses.functional.ring import ring_terms_solve

__all__ = ["Guide", "InfoNCEFunction", "Keys", "LossSpec", "Solution", "ring_terms_solve", "terms_solve"]
