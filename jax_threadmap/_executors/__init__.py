"""The maps wing's executors: where and in what chunks a map's elements run."""
