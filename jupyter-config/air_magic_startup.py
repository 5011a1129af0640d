# Loads the air_magic extension (%%distributed, %distributed) in every IPython kernel
# and terminal of this profile. Installed by `python -m air_magic.autoload enable`;
# remove it with `python -m air_magic.autoload disable` (or delete this file).
try:
    get_ipython().extension_manager.load_extension("air_magic")  # noqa: F821
except Exception as exc:  # noqa: BLE001 - a startup file must never stop the kernel
    print(f"air_magic: the extension was not loaded: {exc}")
