"""reporting: what a Muon chain's step tells the run. The scalars megatron.training's and
Bridge's logs get, and its timers logged beside Megatron's (step_report); the rates it measured,
written as the scale model's rates file (rates_file). Reads the chain by duck typing (it sits
below chain/). Imports the layers below it."""
