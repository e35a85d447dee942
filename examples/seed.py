"""The seed's training script on all cores: its Network class as it was written, its loop
replaced by one hvd_cpu.fit() call (4 processes, each with its shard of the rows, gradients
averaged by Horovod). examples/seed.ipynb is the same as a notebook.

    python examples/seed.py        # writes runs/seed (model.pt, metrics.jsonl, ...)
"""

import torch
from torch import nn

import hvd_cpu
from hvd_cpu.data.demo import make_demo_frame

# The seed reads its own frame, pd.read_pickle('path/to/data'): a `target` column and features.
df = make_demo_frame(rows=20_000, features=8, seed=0)


class Network(nn.Module):
    def __init__(self, input_size):
        super(Network, self).__init__()  # noqa: UP008 (the seed's class, unchanged)

        self.input_size = input_size

        self.linear_1 = nn.Linear(self.input_size, 32)
        self.linear_2 = nn.Linear(32, 1)

    def forward(self, data):
        output = self.linear_1(data)
        output = self.linear_2(output)

        return output


# The seed's loop (DataLoader at batch 64, MSELoss, Adam, 10 epochs), on 4 processes.
result = hvd_cpu.fit(
    df, target="target", model=Network, np=4, epochs=10, batch_size=64, output="runs/seed",
    overwrite=True,
)  # fmt: skip

print(result.history[["epoch", "train_loss", "val_loss"]].to_string(index=False))
print(result.predict(df.drop(columns="target").head()))
torch.save(result.model.state_dict(), "runs/seed/network.pt")  # the seed's own Network
