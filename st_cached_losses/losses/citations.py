"""BibTeX entries for the model cards that sentence-transformers writes (a loss's ``citation``)."""

GRADCACHE_CITATION = """
@misc{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""

MNRL_CITATION = """
@misc{henderson2017efficient,
    title={Efficient Natural Language Response Suggestion for Smart Reply},
    author={Matthew Henderson and Rami Al-Rfou and Brian Strope and Yun-hsuan Sung and Laszlo Lukacs and Ruiqi Guo and Sanjiv Kumar and Balint Miklos and Ray Kurzweil},
    year={2017},
    eprint={1705.00652},
    archivePrefix={arXiv},
    primaryClass={cs.CL}
}
"""

CLIP_CITATION = """
@inproceedings{radford2021learning,
    title={Learning Transferable Visual Models From Natural Language Supervision},
    author={Alec Radford and Jong Wook Kim and Chris Hallacy and Aditya Ramesh and Gabriel Goh and Sandhini Agarwal and Girish Sastry and Amanda Askell and Pamela Mishkin and Jack Clark and Gretchen Krueger and Ilya Sutskever},
    booktitle={International Conference on Machine Learning},
    year={2021},
    eprint={2103.00020},
    archivePrefix={arXiv}
}
"""

INFCL_CITATION = """
@misc{cheng2024breaking,
    title={Breaking the Memory Barrier: Near Infinite Batch Size Scaling for Contrastive Loss},
    author={Zesen Cheng and Hang Zhang and Kehan Li and Sicong Leng and Zhiqiang Hu and Fei Wu and Deli Zhao and Xin Li and Lidong Bing},
    year={2024},
    eprint={2410.17243},
    archivePrefix={arXiv},
    primaryClass={cs.CV}
}
"""

GTE_CITATION = """
@misc{li2023towards,
    title={Towards General Text Embeddings with Multi-stage Contrastive Learning},
    author={Zehan Li and Xin Zhang and Yanzhao Zhang and Dingkun Long and Pengjun Xie and Meishan Zhang},
    year={2023},
    eprint={2308.03281},
    archivePrefix={arXiv},
    primaryClass={cs.CL}
}
"""

HARDNESS_CITATION = """
@misc{lan2025llave,
    title={LLaVE: Large Language and Vision Embedding Models with Hardness-Weighted Contrastive Learning},
    author={Zhibin Lan and Liqiang Niu and Fandong Meng and Jie Zhou and Jinsong Su},
    year={2025},
    eprint={2503.04812},
    archivePrefix={arXiv},
    primaryClass={cs.CV}
}
"""

GIST_CITATION = """
@misc{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Aivin V. Solatorio},
    year={2024},
    eprint={2402.16829},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""

SPLADE_CITATION = """
@misc{formal2022distillationhardnegativesampling,
    title={From Distillation to Hard Negative Sampling: Making Sparse Neural IR Models More Effective},
    author={Thibault Formal and Carlos Lassance and Benjamin Piwowarski and St\\'ephane Clinchant},
    year={2022},
    eprint={2205.04733},
    archivePrefix={arXiv},
    primaryClass={cs.IR},
}
"""

FLOPS_CITATION = """
@article{paria2020minimizing,
    title={Minimizing flops to learn efficient sparse representations},
    author={Paria, Biswajit and Yeh, Chih-Kuan and Yen, Ian EH and Xu, Ning and Ravikumar, Pradeep and P{\\'o}czos, Barnab{\\'a}s},
    journal={arXiv preprint arXiv:2004.05665},
    year={2020}
}
"""

CONTACCUM_CITATION = """
@inproceedings{kim2024gradient,
    title={A Gradient Accumulation Method for Dense Retriever under Memory Constraint},
    author={Jaehee Kim and Yukyung Lee and Pilsung Kang},
    booktitle={Advances in Neural Information Processing Systems},
    year={2024},
    eprint={2406.12356},
    archivePrefix={arXiv},
    primaryClass={cs.IR}
}
"""

DISTILL_KL_CITATION = """
@misc{lin2020distillingdenserepresentationsranking,
      title={Distilling Dense Representations for Ranking using Tightly-Coupled Teachers},
      author={Sheng-Chieh Lin and Jheng-Hong Yang and Jimmy Lin},
      year={2020},
      eprint={2010.11386},
      archivePrefix={arXiv},
      primaryClass={cs.IR},
      url={https://arxiv.org/abs/2010.11386},
}
"""

MARGIN_MSE_CITATION = """
@misc{hofstätter2021improving,
    title={Improving Efficient Neural Ranking Models with Cross-Architecture Knowledge Distillation},
    author={Sebastian Hofstätter and Sophia Althammer and Michael Schröder and Mete Sertkan and Allan Hanbury},
    year={2021},
    eprint={2010.02666},
    archivePrefix={arXiv},
    primaryClass={cs.IR}
}
"""

SIGLIP_CITATION = """
@inproceedings{zhai2023sigmoid,
    title={Sigmoid Loss for Language Image Pre-Training},
    author={Xiaohua Zhai and Basil Mustafa and Alexander Kolesnikov and Lucas Beyer},
    booktitle={Proceedings of the IEEE/CVF International Conference on Computer Vision},
    year={2023},
    eprint={2303.15343},
    archivePrefix={arXiv}
}
"""
