//! `strata-gpucheck`: the checks and benches that validate the CUDA device, one subcommand
//! per step of `scripts/gpu-check.sh`. Kept out of the `strata` binary: it is tooling.

use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};

use strata::device::cuda::context::CudaDevice;
use strata::gpucheck::kernels::{self, CheckRow, CheckSizes};
use strata::gpucheck::{bench, emu::EmuExec, model_checks, serve_checks};
use strata::{errors, flags};

#[derive(Parser)]
#[command(
    name = "strata-gpucheck",
    version,
    about = "Validate strata's CUDA device: kernels, logits, offload, bandwidth, offload bench (see scripts/gpu-check.sh)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Step 1: every CUDA kernel against its CPU twin on random inputs.
    Kernels(Target),
    /// Step 2: logits of the CUDA model vs the CPU model on random Qwen3s.
    Logits(Target),
    /// Step 3: greedy tokens with and without offload on CUDA.
    Offload(Target),
    /// Step 6: the serving path on CUDA: batch invariance, preemption, vs the CPU engine.
    Serve(Target),
    /// Step 4: pinned H2D/D2H bandwidth by copy size, 64 KB..256 MB (GPU only).
    Bandwidth,
    /// Step 5: offload benchmark on a Qwen3-4B-shaped random model (GPU only).
    BenchOffload(BenchArgs),
}

#[derive(Args)]
struct Target {
    /// Run on the CPU kernel emulator of the kernels' own sources (needs a C++17 compiler;
    /// slow: host GEMMs) instead of an NVIDIA GPU.
    #[arg(long)]
    emulate: bool,
}

type Checks = fn() -> Result<Vec<CheckRow>>;

impl Target {
    /// The GPU's or the emulator's version of a check step, its rows printed.
    fn run(&self, what: &str, gpu: Checks, emulated: Checks) -> Result<()> {
        let f = if self.emulate { emulated } else { gpu };
        f().and_then(|r| print_rows(r, what))
    }
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// Layers of Qwen3-4B's 36 to run (all identical; ratios are per layer).
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=36))]
    layers: usize,
    /// Context lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,8192,32768", value_parser = flags::tokens())]
    contexts: Vec<usize>,
    #[arg(long, default_value_t = 16, value_parser = flags::tokens_or_zero())]
    decode_steps: usize,
    #[arg(long, default_value_t = 4, value_parser = flags::kv_buffers())]
    num_kv_buffers: usize,
    #[arg(long, default_value_t = 256, value_parser = flags::block_size())]
    block_size: usize,
}

fn main() -> ExitCode {
    let cli = match errors::parse_args::<Cli>("strata-gpucheck") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let result = match cli.command {
        Command::Kernels(t) => kernel_rows(t.emulate).and_then(|r| print_rows(r, "kernel")),
        Command::Logits(t) => t.run(
            "logits",
            model_checks::logits_check,
            model_checks::logits_check_emulated,
        ),
        Command::Offload(t) => t.run(
            "offload",
            model_checks::offload_check,
            model_checks::offload_check_emulated,
        ),
        Command::Serve(t) => t.run(
            "serve",
            serve_checks::serve_check,
            serve_checks::serve_check_emulated,
        ),
        Command::Bandwidth => run_bandwidth(),
        Command::BenchOffload(args) => run_bench(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => errors::report(&e),
    }
}

fn kernel_rows(emulate: bool) -> Result<Vec<CheckRow>> {
    if emulate {
        let exec = EmuExec::new()?;
        Ok(kernels::run_kernel_checks_on(&exec, CheckSizes::Full))
    } else {
        kernels::run_kernel_checks()
    }
}

/// Prints a check table; fails (one line) when any row failed.
fn print_rows(rows: Vec<CheckRow>, what: &str) -> Result<()> {
    print!("{}", kernels::format_table(&rows));
    let failed = rows.iter().filter(|r| !r.pass).count();
    if failed > 0 {
        bail!("{failed} of {} {what} checks failed", rows.len());
    }
    Ok(())
}

fn run_bandwidth() -> Result<()> {
    let dev = CudaDevice::new(0)?;
    let rows = bench::bandwidth_sweep(&dev, &bench::sweep_sizes())?;
    print!("{}", bench::format_bandwidth(&rows));
    println!(
        "peak H2D {:.1} GB/s on {}",
        bench::peak_h2d(&rows),
        dev.name()
    );
    Ok(())
}

fn run_bench(args: BenchArgs) -> Result<()> {
    // Peak H2D from a short sweep of the large sizes the engine uses.
    let peak = {
        let dev = CudaDevice::new(0)?;
        let sizes = [16 << 20, 64 << 20, 256 << 20];
        bench::peak_h2d(&bench::bandwidth_sweep(&dev, &sizes)?)
    };
    let report = bench::offload_bench(
        &bench::BenchArgs {
            layers: args.layers,
            contexts: args.contexts,
            decode_steps: args.decode_steps,
            num_kv_buffers: args.num_kv_buffers,
            block_size: args.block_size,
        },
        peak,
    )?;
    print!("{report}");
    Ok(())
}
